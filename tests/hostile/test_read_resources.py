"""Inputs built to exhaust a resource fail as one line, exit 4 or 5.

Deep JSON, deep pickles, lying zip sizes and huge declared lengths must never surface as a
RecursionError, MemoryError, zlib.error or BadZipFile traceback, and are refused before the
memory they declare is spent.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.safetensors import MAX_NESTING

CKPT = str(Path(sys.executable).with_name("ckpt"))
DEEP = 100_000


def _ckpt_fails(path: Path, code: int, words: str) -> None:
    command = [CKPT, "inspect", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _deep_pickle() -> bytes:
    # EMPTY_LIST x N, then APPEND x (N - 1): lists nested N deep, built without recursion.
    return b"\x80\x02" + b"]" * DEEP + b"a" * (DEEP - 1) + b"."


def test_deep_json_safetensors_header(tmp_path: Path) -> None:
    header = ('{"a":' + "[" * DEEP + "]" * DEEP + "}").encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CorruptCheckpointError, match="nests too deeply"):
        open_checkpoint(path)
    _ckpt_fails(path, 4, "nests too deeply")


def _nested_entry(path: Path, depth: int) -> Path:
    # An entry field safetensors ignores, holding lists nested `depth` deep: with the header's
    # object and the entry's, `depth + 2` levels.
    field = "[" * depth + "]" * depth
    header = f'{{"w":{{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{field}}}}}'.encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    return path


def test_header_nesting_is_read_as_deep_as_safetensors_reads_it(tmp_path: Path) -> None:
    # Python's json goes as deep as the interpreter's stack allows, which differs between
    # versions; the crate stops at a fixed depth. The oracle decides every case.
    from safetensors import safe_open

    verdicts = {}
    for depth in (1, MAX_NESTING - 2, MAX_NESTING - 1, MAX_NESTING + 40, 900):
        path = _nested_entry(tmp_path / f"d{depth}.safetensors", depth)
        try:
            with safe_open(str(path), framework="pt") as f:
                theirs = list(f.keys())
        except Exception:  # SafetensorError; the oracle's own type does not matter here
            theirs = None
        try:
            ours = list(open_checkpoint(path).root)
        except CorruptCheckpointError as e:
            assert "nests too deeply" in str(e)
            ours = None
        verdicts[depth] = (theirs, ours)
    assert verdicts[MAX_NESTING - 2] == (["w"], ["w"])
    assert all(theirs == ours for theirs, ours in verdicts.values()), verdicts
    assert verdicts[MAX_NESTING - 1] == (None, None)
    _ckpt_fails(tmp_path / f"d{MAX_NESTING + 40}.safetensors", 4, "nests too deeply")


def test_deep_json_shard_index(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}, "x": ' + "[" * DEEP + "]" * DEEP + "}")
    with pytest.raises(CorruptCheckpointError, match="nests too deeply"):
        open_checkpoint(tmp_path)
    _ckpt_fails(tmp_path, 4, "nests too deeply")


def _depth(root: object) -> int:
    depth = 0
    while isinstance(root, list) and root:
        root, depth = root[0], depth + 1
    return depth


def _inspect_reads(path: Path) -> None:
    result = subprocess.run([CKPT, "inspect", str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr, result.stderr


def test_pickle_nested_100k_deep(tmp_path: Path) -> None:
    # torch's weights-only unpickler keeps its own stack and reads any depth: so do we.
    path = tmp_path / "deep.pkl"
    path.write_bytes(_deep_pickle())
    assert _depth(open_checkpoint(path).root) == DEEP - 1
    _inspect_reads(path)


def _torch_zip(tmp_path: Path) -> Path:
    path = tmp_path / "good.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    return path


def test_deep_data_pkl_in_a_torch_zip(tmp_path: Path) -> None:
    src, path = _torch_zip(tmp_path), tmp_path / "deep.pt"
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(path, "w") as b:
        for info in a.infolist():
            deep = info.filename.endswith("/data.pkl")
            b.writestr(info.filename, _deep_pickle() if deep else a.read(info.filename))
    assert _depth(torch.load(path, weights_only=True)) == DEEP - 1
    assert _depth(open_checkpoint(path).root) == DEEP - 1
    _inspect_reads(path)


@pytest.mark.parametrize("length", [1 << 40, 1 << 29], ids=["past-the-limit", "past-the-file"])
def test_pickle_declaring_a_huge_string(length: int, tmp_path: Path) -> None:
    path = tmp_path / "huge.pkl"
    # BINUNICODE8 with a declared length the file does not hold: read no more than is there.
    path.write_bytes(b"\x80\x04\x8d" + struct.pack("<Q", length) + b"abc.")
    error, code = (ResourceLimitError, 5) if length > 1 << 30 else (CorruptCheckpointError, 4)
    with pytest.raises(error):
        open_checkpoint(path)
    _ckpt_fails(path, code, "huge.pkl")


def _deflated_copy(src: Path, dst: Path) -> None:
    """``src``'s members, every one deflated, into the archive ``dst``."""
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as b:
        for info in a.infolist():
            b.writestr(info.filename, a.read(info.filename))


def _central_entry(data: bytes, name: bytes) -> int:
    at = data.index(b"PK\x01\x02")
    while data[at + 46 : at + 46 + len(name)] != name:
        at = data.index(b"PK\x01\x02", at + 4)
    return at


def test_zip_whose_declared_size_lies(tmp_path: Path) -> None:
    """data.pkl deflated, its size shrunk in both headers: inflating finds more than declared."""
    src, path = _torch_zip(tmp_path), tmp_path / "lying.pt"
    _deflated_copy(src, path)
    data = bytearray(path.read_bytes())
    assert data[30 : 30 + 13] == b"good/data.pkl"
    struct.pack_into("<L", data, 22, 10)  # local header: uncompressed size
    struct.pack_into("<L", data, _central_entry(bytes(data), b"good/data.pkl") + 24, 10)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="size or CRC-32"):
        open_checkpoint(path)
    _ckpt_fails(path, 4, "size or CRC-32")


def test_zip_that_does_not_inflate(tmp_path: Path) -> None:
    src, path = _torch_zip(tmp_path), tmp_path / "garbled.pt"
    _deflated_copy(src, path)
    data = bytearray(path.read_bytes())
    data[43:53] = b"\xff" * 10  # the start of data.pkl's deflate stream
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        open_checkpoint(path)
    _ckpt_fails(path, 4, "garbled.pt")


@pytest.mark.parametrize("record", ["end", "zip64-end"])
def test_zip_declaring_a_huge_record_count(record: str, tmp_path: Path) -> None:
    path = tmp_path / "count.pt"
    data = bytearray(_torch_zip(tmp_path).read_bytes())
    if record == "end":
        eocd = data.rindex(b"PK\x05\x06")
        struct.pack_into("<HH", data, eocd + 8, 0xFFFE, 0xFFFE)  # records on disk, in all
    else:
        zip64 = data.rindex(b"PK\x06\x06")
        struct.pack_into("<QQ", data, zip64 + 24, 1 << 60, 1 << 60)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="records"):
        open_checkpoint(path)
    _ckpt_fails(path, 4, "records")


def test_legacy_file_declaring_a_huge_storage(tmp_path: Path) -> None:
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    path = tmp_path / "huge.pt"
    # The storage's element count in its 8-byte header (just before its 8 bytes of data).
    path.write_bytes(data[:-16] + struct.pack("<q", 1 << 60) + data[-8:])
    with pytest.raises(CorruptCheckpointError):
        open_checkpoint(path)
    _ckpt_fails(path, 4, "huge.pt")


def test_pickle_declaring_bytes_larger_than_memory(tmp_path: Path) -> None:
    """BINBYTES8 of 2**61 bytes: CPython allocates before reading, and that MemoryError is ours."""
    path = tmp_path / "bytes8.pkl"
    path.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 61) + b"abc.")
    with pytest.raises(ResourceLimitError):
        open_checkpoint(path)
    _ckpt_fails(path, 5, "bytes8.pkl")
