"""Inputs at the edges: pickle tricks, resource limits, zip64, odd layouts."""

from __future__ import annotations

import argparse
import collections
import io
import json
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools.errors import (
    EXIT_CORRUPT,
    EXIT_RESOURCE,
    CorruptCheckpointError,
    ResourceLimitError,
    VerificationError,
)
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle.unpickler import load_pickle
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers import zipfile as zipwriter
from ckpt_tools.ops.rewrite.conversion import convert
from ckpt_tools.ops.rewrite.rewriting import rewrite, strip_module
from ckpt_tools.structure.keys import add_rule
from ckpt_tools.structure.selection import select_state_dict
from tests.helpers import CountingDict, LookupBudget, ckpt_env, run_ckpt


def text(s: str) -> bytes:
    """BINUNICODE."""
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def zip_with_pickle(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return path


# A float tensor of 2 elements on storage "0": _rebuild_tensor_v2(storage, 0, (2,), (1,), ...)
TENSOR = (
    b"ctorch._utils\n_rebuild_tensor_v2\n("
    + b"(" + text("storage") + b"ctorch\nFloatStorage\n" + text("0") + text("cpu") + b"K\x02tQ"
    + b"K\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR"
)  # fmt: skip


# -- the restricted unpickler ------------------------------------------------------------


def test_build_cannot_turn_an_allowed_global_into_another(tmp_path, capsys):
    """BUILD on a torch.float32 stand-in renamed it os.system; a rewrite then wrote that call."""
    payload = (
        b"\x80\x02}" + text("w")
        + b"ctorch\ndevice\n" + text("cpu") + b"\x85R"  # a recorded call, torch.device('cpu')
        + b"}(" + text("func")
        + b"ctorch\nfloat32\n}(" + text("module") + text("os") + text("name") + text("system")
        + b"ub" + text("args") + text("echo PWNED") + b"\x85ub"
        + b"s."
    )  # fmt: skip
    with pytest.raises(CorruptCheckpointError, match="BUILD"):
        load_pickle(io.BytesIO(payload))
    src = zip_with_pickle(tmp_path / "evil.pt", payload)
    code, _, err = run_ckpt("convert", src, tmp_path / "out.pt", code=None)
    assert code == EXIT_CORRUPT and "BUILD" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.pt").exists()


def test_build_cannot_change_a_checked_tensor():
    plain = b"\x80\x02}" + text("w") + TENSOR + b"s."
    assert load_pickle(io.BytesIO(plain)).root["w"].shape == (2,)  # control
    grown = b"\x80\x02}" + text("w") + TENSOR + b"}" + text("shape") + b"M\xe8\x03\x85sbs."
    with pytest.raises(CorruptCheckpointError, match="BUILD"):
        load_pickle(io.BytesIO(grown))


def test_build_cannot_patch_collections_counter():
    before = collections.Counter.most_common
    payload = b"\x80\x02ccollections\nCounter\nN}" + text("most_common") + b"K\x01s\x86b."
    with pytest.raises(CorruptCheckpointError):
        load_pickle(io.BytesIO(payload))
    assert collections.Counter.most_common is before


def test_counter_still_round_trips(tmp_path):
    src = tmp_path / "c.pt"
    torch.save({"module.w": torch.ones(2), "counts": collections.Counter(a=2)}, src)
    assert ckpt_tools.inspect(src).unsafe_globals == ()
    strip_module(src, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["counts"] == collections.Counter(a=2) and type(out["counts"]) is collections.Counter


@pytest.mark.parametrize("codec", ["rot13", "idna", "zlib", "hex", "uu"])
def test_codecs_encode_takes_only_the_codecs_pickle_writes(codec):
    """Any other codec name makes the codec registry import a module by that name."""
    payload = b"\x80\x02c_codecs\nencode\n" + text("abc") + text(codec) + b"\x86R."
    script = (
        "import io, sys\n"
        "from ckpt_tools.formats.pickle.unpickler import load_pickle\n"
        "from ckpt_tools.errors import CorruptCheckpointError\n"
        "before = set(sys.modules)\n"
        "try:\n"
        f"    load_pickle(io.BytesIO({payload!r}))\n"
        "    print('LOADED')\n"
        "except CorruptCheckpointError as e:\n"
        "    print('REFUSED', e)\n"
        "new = set(sys.modules) - before\n"
        "print(sorted(m for m in new if m.startswith(('encodings', 'string'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=ckpt_env(), timeout=60
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("REFUSED") and codec in lines[0], result.stdout + result.stderr
    assert lines[1] == "[]"


def test_python2_names_of_allowed_builtins_are_allowed(tmp_path):
    """torch.save writes protocol 2, which names builtins ``__builtin__.set`` and so on."""
    obj = {
        "module.w": torch.ones(2),
        "tags": {"a", "b"},
        "raw": bytearray(b"xy"),
        "z": 1j,
        "blob": b"abc",
    }  # not frozenset: torch.load(weights_only=True) refuses it, so it is reported unsafe
    src = tmp_path / "py2names.pt"
    torch.save(obj, src)
    info = ckpt_tools.inspect(src)
    assert info.unsafe_globals == ()
    assert info.entries["blob"] == "bytes b'abc'"
    strip_module(src, tmp_path / "out.pt")  # no --allow-global needed
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    del out["w"], obj["module.w"]
    assert out == obj


# -- resource limits -----------------------------------------------------------------------


def nested(depth: int, key: str = "model") -> bytes:
    return b"\x80\x02" + (b"}" + text(key)) * depth + b"}" + b"s" * depth + b"."


def test_deep_nesting_is_read_as_torch_reads_it(tmp_path):
    # torch's weights-only unpickler keeps its own stack: it reads any depth, and so do we.
    assert load_pickle(io.BytesIO(nested(100_000))).root
    deep_list = b"\x80\x02" + b"]" * 100_000 + b"a" * 99_999 + b"."
    root = load_pickle(io.BytesIO(deep_list)).root
    for _ in range(99_999):
        root = root[0]
    assert root == []
    path = tmp_path / "deep.pkl"
    path.write_bytes(nested(100_000))
    code, _, err = run_ckpt("inspect", path, code=None)
    assert code == 0 and not err, err
    # Deeper than a rewrite writes (torch.save cannot write it either): refused, one line.
    code, _, err = run_ckpt("strip-module", path, tmp_path / "out.pt", code=None)
    assert code == EXIT_RESOURCE and "levels deep" in err and len(err.strip().splitlines()) == 1


def test_nesting_torch_can_write_is_still_read_and_rewritten(tmp_path):
    root: dict[str, Any] = {"w": torch.ones(2)}
    node = root
    for _ in range(150):
        node["n"] = {}
        node = node["n"]
    src = tmp_path / "nested.pt"
    torch.save(root, src)
    rewrite(src, tmp_path / "out.pt", rules=[add_rule("m.")])
    assert "m.w" in torch.load(tmp_path / "out.pt", weights_only=True)


def test_shared_references_do_not_make_selection_exponential():
    # Lookups are counted, not timed: a few dozen per object is linear work (26 today); an
    # exponential walk passes the allowance within 13 levels and fails there, never hangs.
    budget = LookupBudget(allowed=61 * 100)
    x: Any = CountingDict(budget, epoch=1)
    for _ in range(60):
        x = CountingDict(budget, model=x, state_dict=x)  # 2**60 paths, 61 objects
    assert select_state_dict(x).path == ()
    assert budget.spent >= 61, "every object was looked at"


def test_shared_reference_and_huge_int_entries_are_described_safely(tmp_path, capsys):
    shared: Any = 0
    for _ in range(20):
        # Tuples, as torch's weights-only allowlist has no frozenset; repr() is 2**20 long.
        shared = ((shared, 1), (shared, 2))
    path = tmp_path / "values.pkl"
    path.write_bytes(pickle.dumps({"shared": shared, "big": 10**5000, "key": {10**5000: 1}}, 2))
    # In a fresh process with a generous timeout, not against a clock: a repr() walking the
    # shared references would take long, and the timeout turns a hang into a failure.
    entries = json.loads(run_ckpt("inspect", "--json", path, how="module").stdout)["entries"]
    assert entries["big"].startswith("int <int of ")
    assert len(entries["shared"]) < 100
    assert ckpt_tools.inspect(path).entries == entries  # the same here, now known to finish


def test_a_value_expanding_past_the_limit_is_a_memo_bomb_even_where_nothing_hashes_it(tmp_path):
    # 2**60 nodes as a dict *value*: the unpickler would not hang on it (values are not
    # hashed), but every walk that expands it would, so it is refused before unpickling
    # (exit 5), in a plain pickle as in a torch zip (tests/hostile/test_read_memo_bomb.py).
    bomb: Any = 0
    for _ in range(60):
        bomb = ((bomb, 1), (bomb, 2))
    path = tmp_path / "values.pkl"
    path.write_bytes(pickle.dumps({"bomb": bomb}, 2))
    with pytest.raises(ResourceLimitError, match="memo bomb"):
        ckpt_tools.inspect(path)


# -- formats ---------------------------------------------------------------------------------


def test_legacy_storage_count_must_match_the_pickle(tmp_path):
    src = tmp_path / "legacy.pt"
    sd = {"w": torch.arange(4.0), "v": torch.arange(3.0)}
    torch.save(sd, src, _use_new_zipfile_serialization=False)
    ckpt = open_checkpoint(src)
    first = ckpt.span(ckpt.root["w"].storage)
    data = bytearray(src.read_bytes())
    data[first.offset - 8 : first.offset] = struct.pack("<q", 5)  # the file says 5 elements
    # ... and a 4-byte longer record, so the file is not merely truncated
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data[: first.offset + 16]) + b"\0" * 4 + bytes(data[first.offset + 16 :]))
    with pytest.raises(RuntimeError):
        torch.load(bad, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="holds 5 elements in the file"):
        open_checkpoint(bad)


def test_safetensors_negative_dimension_is_refused(tmp_path):
    header = json.dumps({"x": {"dtype": "F32", "shape": [-1, 0], "data_offsets": [0, 0]}})
    path = tmp_path / "neg.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    with pytest.raises(CorruptCheckpointError, match="shape"):
        open_checkpoint(path)


@pytest.mark.parametrize("weight_map", [[1, 2], {"a": 5}, "x"])
def test_malformed_shard_index_is_one_line(tmp_path, capsys, weight_map):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, _, err = run_ckpt("inspect", tmp_path, code=None)
    assert code == EXIT_CORRUPT and "weight_map" in err and len(err.strip().splitlines()) == 1


# -- writing ---------------------------------------------------------------------------------


def test_zip64_records_load_in_torch_and_zipfile(tmp_path, monkeypatch):
    """Every size, offset and count takes the zip64 path (thresholds moved down)."""
    monkeypatch.setattr(zipwriter, "_ZIP64_AT", 64)
    monkeypatch.setattr(zipwriter, "_ZIP64_ENTRIES", 2)
    sd = {
        "big": torch.randn(512, 1024),  # 2 MiB: 64 KiB-aligned, padding left as a hole
        "ints": torch.arange(10),
        "view": torch.randn(4, 3).t(),
    }
    src = tmp_path / "src.pt"
    torch.save(sd, src)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "src.safetensors")
    outs = [
        # CRCs known
        rewrite(src, tmp_path / "copied.pt", rules=[add_rule("m.")], verify="full").dst,
        convert(tmp_path / "src.safetensors", tmp_path / "computed.pt", verify="full").dst,
    ]
    for out, prefix in zip(outs, ("m.", "")):
        with zipfile.ZipFile(out) as z:
            assert z.testzip() is None
            infos = z.infolist()
            assert all(i.extra[:2] == b"\x01\x00" for i in infos)  # a zip64 extra on every one
            assert any(i.header_offset >= 1 << 20 for i in infos)
        raw = Path(out).read_bytes()
        assert raw.rfind(struct.pack("<I", 0x06064B50)) > 0  # zip64 end record and locator
        assert raw.rfind(struct.pack("<I", 0x07064B50)) > 0
        for mmap in (False, True):
            loaded = torch.load(out, weights_only=True, mmap=mmap)
            for k, v in sd.items():
                assert torch.equal(loaded[prefix + k], v), (out, k, mmap)
        assert len(ckpt_tools.inspect(out).tensors) == 3


def test_verify_refuses_an_output_with_new_globals(tmp_path):
    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2)}, src)
    out = tmp_path / "out.pt"
    torch.save({"w": torch.ones(2), "x": argparse.Namespace(lr=1)}, out)
    source = open_checkpoint(src)
    with pytest.raises(VerificationError, match="globals outside the allowlist"):
        verify_output(str(out), Expected(source.root, (), source))


class Holder:
    """A training object that keeps the weights as an attribute (a class outside the allowlist)."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        self.state_dict = sd
        self.epoch = 3


def test_rewrite_a_state_dict_held_by_an_object(tmp_path, capsys):
    sd = {"module.fc.weight": torch.randn(2, 2), "module.fc.bias": torch.randn(2)}
    allow = ("--allow-global", f"{__name__}.Holder")
    torch.save(Holder(sd), tmp_path / "root.pt")  # found by itself: the root's state_dict
    torch.save({"trainer": Holder(sd), "step": 7}, tmp_path / "nested.pt")
    for name, select in (("root", ()), ("nested", ("--select", "trainer.state_dict"))):
        out = tmp_path / f"{name}.out.pt"
        code, _, err = run_ckpt(
            "strip-module", tmp_path / f"{name}.pt", out, *allow, *select, code=None
        )
        assert code == 0, err
        loaded = torch.load(out, weights_only=False)
        holder = loaded if name == "root" else loaded["trainer"]
        assert list(holder.state_dict) == ["fc.weight", "fc.bias"] and holder.epoch == 3
    assert loaded["step"] == 7
    code, _, err = run_ckpt(
        "convert", tmp_path / "root.pt", tmp_path / "o.safetensors", *allow, code=None
    )
    assert code == 7 and "epoch" in err  # the object's other attributes are entries too


def legacy_with_view(path: Path, tensor_numel: int) -> Path:
    """A pre-1.0 style legacy file: a tensor on a 2-element view at element 4 of an 8-float root."""
    storage_id = (
        b"(" + text("storage") + b"ctorch\nFloatStorage\n" + text("root") + text("cpu") + b"K\x08"
        + b"(" + text("view") + b"K\x04K\x02t" + b"tQ"
    )  # fmt: skip
    main_pickle = (
        b"\x80\x02}" + text("w") + b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage_id
        + b"K\x00K" + bytes([tensor_numel]) + b"\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRs."
    )  # fmt: skip
    buf = io.BytesIO()
    for value in (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True}):
        pickle.dump(value, buf, protocol=2)
    buf.write(main_pickle)
    pickle.dump(["root"], buf, protocol=2)
    buf.write(struct.pack("<q", 8) + struct.pack("<8f", *range(8)))
    path.write_bytes(buf.getvalue())
    return path


def test_legacy_view_tensor_must_fit_its_view(tmp_path):
    from ckpt_tools.loading.tensor_io import read_tensor

    ok = open_checkpoint(legacy_with_view(tmp_path / "ok.pt", 2))
    assert ok.format == "torch-legacy"
    assert read_tensor(ok, ok.root["w"]).tolist() == [4.0, 5.0]
    assert torch.load(ok.path, weights_only=True)["w"].tolist() == [4.0, 5.0]  # the oracle
    bad = legacy_with_view(tmp_path / "bad.pt", 4)
    with pytest.raises(RuntimeError):
        torch.load(bad, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="holds 2 elements"):
        open_checkpoint(bad)


def test_empty_tensors_with_any_strides_convert(tmp_path):
    sd = {"e": torch.empty(3, 0).t(), "z": torch.empty(0, 4)[:, ::2], "w": torch.ones(2)}
    src = tmp_path / "empty.pt"
    torch.save(sd, src)
    assert open_checkpoint(src).root["z"].stride == (4, 2)  # not row-major strides
    convert(src, tmp_path / "empty.safetensors", verify="full")
    from safetensors.torch import load_file

    out = load_file(tmp_path / "empty.safetensors")
    assert {k: tuple(v.shape) for k, v in out.items()} == {k: tuple(v.shape) for k, v in sd.items()}
