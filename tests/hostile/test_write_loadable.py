"""Every output loads with torch, and declared output sizes are checked before memory or disk
is spent (convert).

torch is the oracle: it reads the hostile inputs, and it must read every output back with
``weights_only=True`` and ``mmap=True``, bitwise equal.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.errors import ConversionError, OutputError, ResourceLimitError, VerificationError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle.repickle import check_weights_only_pickle, unsupported_opcodes
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.zipcheck import check_torch_zip
from ckpt_tools.ops.rewrite.conversion import convert
from ckpt_tools.ops.rewrite.rewriting import strip_module
from tests.helpers.files import break_crc, deflated_copy

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _ckpt(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPT, *map(str, args)], capture_output=True, text=True, timeout=120)


def _state() -> dict[str, torch.Tensor]:
    return {
        "module.fc.weight": torch.arange(12.0).reshape(3, 4),
        "module.fc.bias": torch.tensor([1, 2, 3], dtype=torch.int16),
        "module.t": torch.arange(6.0).reshape(2, 3).t(),  # a view, kept as a view
        "module.h": torch.arange(5, dtype=torch.bfloat16),
    }


def _stripped() -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in _state().items()}


def _load_both(path: Path) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about pickle protocols other than 2
        return [torch.load(path, weights_only=True), torch.load(path, weights_only=True, mmap=True)]


def _assert_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].stride() == v.stride(), k
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("verify", ["sizes", "full"])
def test_deflated_records_are_written_stored_and_load(verify, tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save(_state(), plain)
    src = deflated_copy(plain, tmp_path / "in.pt")
    _assert_equal(torch.load(src, weights_only=True), _state())  # torch reads deflated zips
    dst = tmp_path / "out.pt"
    result = _ckpt("strip-module", src, dst, "--verify", verify)
    assert result.returncode == 0, result.stderr
    with zipfile.ZipFile(dst) as archive:
        assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}
    for loaded in _load_both(dst):
        _assert_equal(loaded, _stripped())
    assert check_torch_zip(str(dst)) > 0


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("protocol", [4, 5])
def test_pickle_protocol_4_and_5_inputs_come_out_as_protocol_2(protocol, tmp_path):
    src = tmp_path / "in.pt"
    torch.save(_state(), src, pickle_protocol=protocol)
    with pytest.raises(pickle.UnpicklingError):  # the input itself: torch's own refusal
        torch.load(src, weights_only=True)
    dst = tmp_path / "out.pt"
    strip_module(src, dst)
    with zipfile.ZipFile(dst) as archive:
        payload = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    assert payload[:2] == b"\x80\x02" and unsupported_opcodes(payload) == []
    for loaded in _load_both(dst):
        _assert_equal(loaded, _stripped())


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_inspect_says_when_torch_weights_only_refuses_the_protocol(protocol, tmp_path):
    # We read protocols 4 and 5 (torch.load(weights_only=False) reads them, with the same
    # meaning); inspect says so exactly when torch's weights-only unpickler refuses the file.
    src = tmp_path / "in.pt"
    torch.save(_state(), src, pickle_protocol=protocol)
    try:
        torch.load(src, weights_only=True)
        torch_refuses = False
    except pickle.UnpicklingError:
        torch_refuses = True
    info = ckpt_tools.inspect(src)
    assert info.pickle_protocol == protocol == info.to_json()["pickle_protocol"]
    assert bool(info.beyond_weights_only) == torch_refuses
    assert info.to_json()["beyond_weights_only"] == list(info.beyond_weights_only)
    note = [line for line in info.summary(for_cli=True).splitlines() if line.startswith("pickle:")]
    assert bool(note) == torch_refuses
    if note:
        assert f"protocol {protocol}" in note[0] and f"ckpt convert {src} OUT.pt" in note[0]


def test_an_int_only_long4_holds_is_named_and_the_fix_writes_the_tensors_alone(tmp_path):
    # 1 << 2100 needs LONG4, which torch's weights-only unpickler lacks and no repickling
    # avoids: a torch output is refused, and inspect names the safetensors one that works.
    import shlex

    from tests.helpers import run_ckpt

    src = tmp_path / "big.pt"
    torch.save({"w": torch.ones(2), "seed": 1 << 2100}, src)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)
    note = next(
        ln for ln in run_ckpt("inspect", src).stdout.splitlines() if ln.startswith("pickle:")
    )
    assert "an int of 256 bytes or more has no opcode it reads" in note, note
    fix = note.split("`")[1]
    assert fix == f"ckpt convert {src} OUT.safetensors --drop-extras"
    run_ckpt(*shlex.split(fix.replace("OUT", str(tmp_path / "out")))[1:])
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], torch.ones(2))
    with pytest.raises(ConversionError, match="needs LONG4, which no rewrite avoids: leave it out"):
        convert(src, tmp_path / "out.pt")


@pytest.mark.parametrize("reread", [True, False], ids=["reads-directory", "opened-records"])
def test_default_verification_is_torch_strict(reread, tmp_path):
    # The strict re-read refuses what torch.load(mmap=True) or weights_only=True cannot read,
    # whether it reads the directory itself or takes the records open_checkpoint just read
    # (as a rewrite's verification does): the same verdicts, in the same words.
    def check(path: Path) -> int:
        return check_torch_zip(str(path), None if reread else open_checkpoint(path))

    plain = tmp_path / "plain.pt"
    torch.save(_state(), plain)
    assert check(plain) == len(zipfile.ZipFile(plain).namelist())
    with pytest.raises(VerificationError, match=r"record '[^'/]+' is compressed"):
        check(deflated_copy(plain, tmp_path / "deflated.pt"))
    p4 = tmp_path / "p4.pt"
    torch.save(_state(), p4, pickle_protocol=4)
    with pytest.raises(VerificationError, match=r"opcodes .*FRAME"):
        check(p4)


def test_opcode_check_agrees_with_torch():
    # Protocol 2 pickles torch writes pass; an opcode its unpickler rejects is caught before
    # any byte is written.
    assert unsupported_opcodes(pickle.dumps({"a": [1, 2.5, None, True, "x"]}, protocol=2)) == []
    with pytest.raises(ConversionError, match="LONG4"):
        check_weights_only_pickle(pickle.dumps(1 << 4000, protocol=2))


# --------------------------------------------------------------------------------------------
# Declared sizes (convert)
# --------------------------------------------------------------------------------------------


def _zero_stride(path: Path) -> Path:
    # One element viewed as 2**40 elements: 4 bytes on disk, 4 TiB once written contiguous.
    huge = torch.ones(1).as_strided((2**40,), (0,))
    torch.save({"v": huge, "w": torch.arange(3.0)}, path)
    return path


def test_zero_stride_view_is_refused_before_writing(tmp_path):
    src = _zero_stride(tmp_path / "in.pt")
    result = _ckpt("convert", src, tmp_path / "out.safetensors")
    assert result.returncode == 5, result.stderr
    assert "would grow by more than 1 GiB" in result.stderr.splitlines()[0]
    with pytest.raises(ResourceLimitError, match=r"\[1099511627776\] stride \[0\]"):
        convert(src, tmp_path / "out.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_zero_stride_view_stays_a_view_in_torch_outputs(tmp_path):
    src = _zero_stride(tmp_path / "in.pt")
    dst = tmp_path / "out.pt"
    result = _ckpt("rename", src, dst, "--sub", "w=weight")
    assert result.returncode == 0, result.stderr
    for loaded in _load_both(dst):
        assert loaded["v"].stride() == (0,) and loaded["v"].shape == (2**40,)
        assert loaded["v"].untyped_storage().nbytes() == 4
        assert torch.equal(loaded["weight"], torch.arange(3.0))


def test_outputs_larger_than_the_free_space_are_refused(tmp_path):
    # A disk too small is refused as one that fills while writing is (exit 6).
    with pytest.raises(OutputError, match="free") as info:
        check_output_size([], 1 << 62, tmp_path / "out.pt")
    assert info.value.exit_code == 6


def test_strided_views_of_a_large_storage_are_gathered_in_pieces(tmp_path):
    # A view spanning more than MAX_GATHER_SPAN of its storage is read in parts; the bytes
    # must still be exactly torch's .contiguous() ones.
    from safetensors.torch import load_file

    from ckpt_tools.io.tensor_bytes import MAX_GATHER_SPAN

    base = torch.arange(MAX_GATHER_SPAN // 4 + 4099, dtype=torch.float32)
    views = {
        "every7": base[3::7],
        "grid": base[: (len(base) // 4096) * 4096].view(-1, 4096)[::3, 5::2],
        "transposed": base[: 2048 * 2048].view(2048, 2048).t(),
    }
    src = tmp_path / "in.pt"
    torch.save(views, src)
    dst = tmp_path / "out.safetensors"
    convert(src, dst, verify="full")
    got = load_file(dst)
    for name, view in views.items():
        assert torch.equal(got[name], view.contiguous()), name


@pytest.mark.parametrize(
    "args",
    [
        ("convert", "out.safetensors", "--verify", "full"),
        ("convert", "out/", "--verify", "full"),
        ("strip-module", "out.safetensors", "--verify", "full"),
        ("slim", "out.safetensors", "--dtype", "bf16", "--verify", "full"),
        ("diff", "plain.pt"),
    ],
    ids=["safetensors", "folder", "strip-module", "slim", "diff"],
)
def test_deflated_storages_are_read_as_torch_reads_them_by_every_command(args, tmp_path):
    # Spans of a deflated record are read from its inflated copy, removed once done.
    plain = tmp_path / "plain.pt"
    torch.save(_state(), plain)
    src = deflated_copy(plain, tmp_path / "in.pt")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command, out, *rest = args
    result = subprocess.run(
        [CKPT, command, str(src), f"{tmp_path}/{out}", *rest],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert result.returncode == 0, result.stderr
    assert list(scratch.iterdir()) == []
    want = torch.load(src, weights_only=True)
    if command == "diff":
        assert "identical: same keys, every tensor bit-equal" in result.stdout
        return
    from safetensors.torch import load_file

    if out.endswith("/"):
        (shard,) = (tmp_path / out).glob("*.safetensors")
        got = load_file(shard)
    else:
        got = load_file(tmp_path / out)
    for key, value in want.items():
        key = key.removeprefix("module.") if command == "strip-module" else key
        if command == "slim" and value.is_floating_point():
            value = value.to(torch.bfloat16)
        assert torch.equal(got[key], value.contiguous()), key


@pytest.mark.parametrize(
    "args",
    [
        ("convert", "out.pt"),
        ("convert", "out.safetensors"),
        ("convert", "out/"),
        ("diff", "plain.pt"),
    ],
    ids=["pt", "safetensors", "folder", "diff"],
)
def test_a_deflated_record_failing_its_crc_is_refused_as_corrupt_by_every_reader(args, tmp_path):
    # torch inflates it unchecked; values nobody can vouch for are refused alike (exit 4),
    # never as an output that failed (6).
    plain = tmp_path / "plain.pt"
    torch.save(_state(), plain)
    src = deflated_copy(plain, tmp_path / "in.pt")
    break_crc(src)
    torch.load(src, weights_only=True)  # torch checks no CRC-32
    command, out = args
    result = _ckpt(command, src, f"{tmp_path}/{out}")
    assert result.returncode == 4, result.stderr
    assert "CRC-32" in result.stderr
    assert command == "diff" or not (tmp_path / out.rstrip("/")).exists()
