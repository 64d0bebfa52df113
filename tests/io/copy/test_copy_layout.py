"""Key-only rewrites keep the source's layout: records at the same offset modulo 4096.

Oracles: Python's ``zipfile`` (where each record's bytes start, their CRC-32s),
``torch.load(weights_only=True, mmap=True)``, ``safetensors.safe_open`` and the JSON header
as ``struct`` reads it; never this package's own reader alone.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle import expansion
from ckpt_tools.io.copy.clone import COPY_METHODS
from ckpt_tools.io.copy.layout import plan_zip_layout, zip_actions
from ckpt_tools.io.writers.zipfile import SAVE_HEAD_RECORDS, SAVE_VERSION
from ckpt_tools.ops.rewrite.conversion import retag
from ckpt_tools.ops.rewrite.rewriting import add_module, rename, strip_module
from ckpt_tools.structure.keys import sub_rule
from tests import helpers as h

BLOCK = 4096


def _state(prefix: str = "module.", n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    # Odd sizes, so records end at every residue and the padding has work to do.
    return {f"{prefix}layer{i}.weight": torch.randn(37 + 29 * i, 7, generator=g) for i in range(n)}


def _zip_data_offsets(path: Path) -> dict[str, int]:
    """Record name (inside the root folder) -> where its bytes start, read with ``zipfile``."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        assert z.testzip() is None  # every CRC-32 checks out
        for info in z.infolist():
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            out[info.filename.split("/", 1)[1]] = info.header_offset + 30 + name_len + extra_len
    return out


def _safetensors_layout(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """``(data start, name -> data_offsets)`` from the file's own header bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return 8 + n, {k: tuple(v["data_offsets"]) for k, v in header.items()}


def _assert_torch_equal(path: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert list(loaded) == list(expected)
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


REWRITES = {
    "strip-module": lambda src, dst: strip_module(src, dst),
    "add-module": lambda src, dst: add_module(src, dst, prefix="wrapper."),
    "rename": lambda src, dst: rename(src, dst, rules=[sub_rule("module.layer", "block")]),
    "retag": lambda src, dst: retag(src, dst, mapping={"cpu": "cuda:0"}),
}


def _renamed(command: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if command == "strip-module":
        return {k.removeprefix("module."): v for k, v in sd.items()}
    if command == "add-module":
        return {f"wrapper.{k}": v for k, v in sd.items()}
    if command == "rename":
        return {k.replace("module.layer", "block", 1): v for k, v in sd.items()}
    return sd


@pytest.mark.parametrize("command", sorted(REWRITES))
def test_zip_records_keep_their_offset_modulo_4096(tmp_path: Path, command: str) -> None:
    sd = _state()
    src = h.save(sd, tmp_path / "in.pt")
    dst = tmp_path / "out.pt"
    REWRITES[command](src, dst)
    before, after = _zip_data_offsets(src), _zip_data_offsets(dst)
    storages = [name for name in before if name.startswith("data/")]
    assert storages and set(storages) <= set(after)
    assert {n: after[n] % BLOCK for n in storages} == {n: before[n] % BLOCK for n in storages}
    # The record bytes themselves are the source's.
    src_bytes, dst_bytes = src.read_bytes(), dst.read_bytes()
    for name in storages:
        size = zipfile.ZipFile(src).getinfo(f"in/{name}").file_size
        assert dst_bytes[after[name] : after[name] + size] == src_bytes[before[name] :][:size]
    if command == "retag":
        loaded = torch.load(dst, weights_only=True, mmap=True, map_location="cpu")
        assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    else:
        _assert_torch_equal(dst, _renamed(command, sd))


def test_a_torch_save_file_is_one_run_after_data_pkl(tmp_path: Path) -> None:
    src = h.save(_state(n=30), tmp_path / "in.pt")
    ckpt = open_checkpoint(str(src))
    fd = os.open(src, os.O_RDONLY)
    try:
        as_saved = dict((*SAVE_HEAD_RECORDS, SAVE_VERSION))
        wanted = {n for n in ckpt.records if n.startswith("data/")}
        layout = plan_zip_layout(ckpt, fd, zip_actions(ckpt, fd, as_saved, wanted))
    finally:
        os.close(fd)
    # data.pkl is written anew; every other record (bookkeeping, 30 storages, version,
    # serialization id) is one range of the source, copied in one call.
    assert list(layout.end_before) == ["data.pkl"]
    assert len(layout.runs) == 1
    assert layout.members == set(ckpt.records) - {"data.pkl"}


def test_the_output_is_the_source_but_for_data_pkl_when_the_pickle_shrinks(
    tmp_path: Path,
) -> None:
    sd = _state()
    src = h.save(sd, tmp_path / "in.pt")
    dst = tmp_path / "out.pt"
    strip_module(src, dst)
    before, after = _zip_data_offsets(src), _zip_data_offsets(dst)
    # The shorter pickle is padded up to where the source's next record began.
    assert {n: after[n] for n in before if n != "data.pkl"} == {
        n: before[n] for n in before if n != "data.pkl"
    }


def test_a_longer_pickle_moves_records_by_whole_blocks(tmp_path: Path) -> None:
    sd = _state(prefix="", n=40)
    src = h.save(sd, tmp_path / "in.pt")
    dst = tmp_path / "out.pt"
    add_module(src, dst, prefix="a_rather_long_wrapper_name_that_grows_the_pickle." * 3)
    before, after = _zip_data_offsets(src), _zip_data_offsets(dst)
    moved = {after[n] - before[n] for n in before if n.startswith("data/")}
    assert len(moved) == 1 and moved.pop() % BLOCK == 0
    _assert_torch_equal(
        dst,
        {"a_rather_long_wrapper_name_that_grows_the_pickle." * 3 + k: v for k, v in sd.items()},
    )


def test_a_rezipped_source_without_data_descriptors_keeps_its_layout(tmp_path: Path) -> None:
    """zipfile writes plain local headers (no data descriptor, no padding field)."""
    sd = _state()
    saved = h.save(sd, tmp_path / "saved.pt")
    src = tmp_path / "in.pt"
    with zipfile.ZipFile(saved) as z, zipfile.ZipFile(src, "w") as out:
        for info in z.infolist():
            out.writestr(info.filename.replace("saved/", "in/"), z.read(info))
    dst = tmp_path / "out.pt"
    strip_module(src, dst)
    _assert_torch_equal(dst, _renamed("strip-module", sd))
    before, after = _zip_data_offsets(src), _zip_data_offsets(dst)
    # zipfile does not align storages to 64 bytes; the output must (mmap loads need it),
    # so the records torch reads in place are all aligned whatever the source did.
    assert all(after[n] % 64 == 0 for n in after if n.startswith("data/"))
    assert set(after) >= {n for n in before if n.startswith("data/")}


@pytest.mark.parametrize("damage", ["descriptor", "extra-field", "padding"])
def test_a_damaged_header_or_descriptor_is_written_anew_not_copied(
    tmp_path: Path, damage: str
) -> None:
    """A record whose header or data descriptor is not exactly what it should be is not copied
    as it is: it gets a fresh header; the output still reads everywhere."""
    sd = _state()
    src = h.save(sd, tmp_path / "in.pt")
    offsets = _zip_data_offsets(src)
    info = zipfile.ZipFile(src).getinfo("in/data/3")
    raw = bytearray(src.read_bytes())
    if damage == "descriptor":
        at = offsets["data/3"] + info.file_size
        assert raw[at : at + 4] == b"PK\x07\x08"
        raw[at + 4 : at + 8] = b"\0\0\0\0"  # the CRC it states no longer matches
    elif damage == "extra-field":
        at = info.header_offset + 30 + len(info.filename.encode())
        assert raw[at : at + 2] == b"FB"
        raw[at : at + 2] = b"XY"  # an extra field of an unknown kind
    else:
        # Bytes hidden in a padding field are not carried over unread.
        for info in zipfile.ZipFile(src).infolist():
            at = info.header_offset + 30 + len(info.filename.encode())
            padded = raw[at : at + 2] == b"FB" and struct.unpack_from("<H", raw, at + 2)[0] >= 6
            if padded and "/data/" in info.filename:
                break
        raw[at + 4 : at + 10] = b"SECRET"
    src.write_bytes(bytes(raw))
    dst = tmp_path / "out.pt"
    strip_module(src, dst)
    _assert_torch_equal(dst, _renamed("strip-module", sd))
    out = dst.read_bytes()
    if damage == "descriptor":
        assert bytes(raw[at : at + 16]) not in out
    elif damage == "extra-field":
        assert b"XY" + raw[at + 2 : at + 4] not in out
    else:
        assert b"SECRET" not in out


def test_safetensors_data_keeps_its_offset_when_the_header_shrinks(tmp_path: Path) -> None:
    sd = _state()
    src = tmp_path / "in.safetensors"
    save_file(sd, src, metadata={"format": "pt"})
    dst = tmp_path / "out.safetensors"
    strip_module(src, dst)
    (start_in, offsets_in), (start_out, offsets_out) = (
        _safetensors_layout(src),
        _safetensors_layout(dst),
    )
    assert start_out == start_in
    assert offsets_out == {k.removeprefix("module."): v for k, v in offsets_in.items()}
    assert dst.read_bytes()[start_out:] == src.read_bytes()[start_in:]
    with safe_open(dst, "pt") as f:
        assert sorted(f.keys()) == sorted(_renamed("strip-module", sd))
        assert all(torch.equal(f.get_tensor(k.removeprefix("module.")), v) for k, v in sd.items())


def test_safetensors_data_keeps_its_offset_modulo_4096_when_the_header_grows(
    tmp_path: Path,
) -> None:
    sd = _state(prefix="")
    src = tmp_path / "in.safetensors"
    save_file(sd, src)
    dst = tmp_path / "out.safetensors"
    prefix = "wrapper." * 40
    add_module(src, dst, prefix=prefix)
    start_in, _ = _safetensors_layout(src)
    start_out, _ = _safetensors_layout(dst)
    assert start_out > start_in and start_out % BLOCK == start_in % BLOCK
    with safe_open(dst, "pt") as f:
        assert all(torch.equal(f.get_tensor(prefix + k), v) for k, v in sd.items())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_every_copy_method_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str
) -> None:
    sd = _state(n=20)
    src = tmp_path / f"in{suffix}"
    if suffix == ".pt":
        h.save(sd, src)
    else:
        save_file(sd, src)
    outputs = {}
    for method in COPY_METHODS:
        h.force_copy_method(monkeypatch, method)
        dst = tmp_path / f"{method}{suffix}"
        strip_module(src, dst)
        outputs[method] = dst.read_bytes()
    assert len(set(outputs.values())) == 1
    assert h.load(tmp_path / f"readwrite{suffix}").keys() == _renamed("strip-module", sd).keys()


def test_the_console_script_rewrites_as_a_read_write_copy_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sd = _state()
    src = h.save(sd, tmp_path / "in.pt")
    h.run_ckpt("strip-module", src, tmp_path / "out.pt", how="script")
    h.force_copy_method(monkeypatch, "readwrite")
    h.run_ckpt("strip-module", src, tmp_path / "readwrite.pt")
    assert (tmp_path / "out.pt").read_bytes() == (tmp_path / "readwrite.pt").read_bytes()
    _assert_torch_equal(tmp_path / "out.pt", _renamed("strip-module", sd))


def test_progress_counts_the_tensor_bytes_of_a_run_exactly(tmp_path: Path) -> None:
    sd = _state(n=9)
    src = h.save(sd, tmp_path / "in.pt")
    seen: list[tuple[int, int]] = []
    strip_module(src, tmp_path / "out.pt", progress=lambda done, total: seen.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    assert seen and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_rewrite_scans_each_pickle_once(tmp_path: Path) -> None:
    # The output's data.pkl is checked as it is written, when its archive is verified and
    # when it is read back: one opcode scan serves all three.
    src = h.save({f"module.l{i}": torch.zeros(2) for i in range(50)}, tmp_path / "in.pt")
    expansion._remembered_scan.cache_clear()
    strip_module(src, tmp_path / "out.pt")
    info = expansion._remembered_scan.cache_info()
    assert (info.misses, info.hits) == (2, 2)  # the input's pickle, then the output's
    # Another payload is scanned on its own, never answered from the output's result.
    payload = h.read_data_pkl(tmp_path / "out.pt")
    other = payload.replace(b"\x80\x02", b"\x80\x04", 1)
    assert expansion.scan_pickle(payload).protocols == (2,)
    assert expansion.scan_pickle(other).protocols == (4,)
    bomb = b"\x80\x02}N" + b"2\x86" * 40 + b"N" + b"s."
    for _ in range(2):  # a refusal is never remembered as a pass
        with pytest.raises(ResourceLimitError, match="memo bomb"):
            expansion.scan_pickle(bomb)
