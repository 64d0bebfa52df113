"""``ckpt scan`` walks every pickle torch.load(weights_only=False) unpickles, where the C
unpickler starts it: past a FRAME read whole, past a count pickle of any size."""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
from pathlib import Path

import torch

from ckpt_tools import scan
from ckpt_tools.ops.scan.report import FileScan
from tests.helpers.child_oracle import run_script

_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b"."


def _touch(marker: Path) -> bytes:
    """A protocol 2 pickle that calls builtins.open(marker, "w"): it creates an empty file."""
    raw = str(marker).encode()
    return (
        b"\x80\x02c__builtin__\nopen\nX"
        + len(raw).to_bytes(4, "little")
        + raw
        + b"X\x01\x00\x00\x00w\x86R."
    )


def _sys_info(little_endian: bool) -> bytes:
    info = {"protocol_version": 1001, "little_endian": little_endian, "type_sizes": {}}
    return pickle.dumps(info, 2)


def _framed(body: bytes, length: int) -> bytes:
    """PROTO 4, then a FRAME of ``length`` bytes that starts with ``body``."""
    return b"\x80\x04\x95" + struct.pack("<Q", length) + body.ljust(length, b"\x00")


def _torch_runs(path: Path, marker: Path) -> bool:
    """Whether torch.load(weights_only=False), in a child process, creates ``marker``."""
    load = "torch.load(sys.argv[1], weights_only=False)"
    run_script(f"import sys, torch\ntry: {load}\nexcept Exception: pass", path, check=True)
    return marker.exists()


def _legacy_behind_a_frame(tmp_path: Path, little_endian: bool) -> tuple[Path, Path]:
    """A legacy file whose magic number sits in a FRAME longer than the open() buffer, with
    benign decoy pickles after its STOP inside the frame; the real pickles follow it."""
    marker = tmp_path / "ran"
    decoys = pickle.dumps(1001, 2) + _sys_info(True) + pickle.dumps({}, 2) + pickle.dumps([], 2)
    first = _framed(_MAGIC + decoys, 20000)
    real = pickle.dumps(1001, 2) + _sys_info(little_endian) + _touch(marker) + pickle.dumps([], 2)
    path = tmp_path / "legacy.pt"
    path.write_bytes(first + real)
    return path, marker


def test_a_legacy_payload_behind_a_frame_is_dangerous_though_big_endian(tmp_path: Path) -> None:
    path, marker = _legacy_behind_a_frame(tmp_path, little_endian=False)
    assert _torch_runs(path, marker)  # torch ignores the byte order sys_info claims
    (result,) = scan([path]).files
    assert result.verdict == "dangerous"
    assert _dangerous(result) == [("builtins.open", "main pickle")]


def _dangerous(result: FileScan) -> list[tuple[str | None, str]]:
    return [(f.global_name, f.record) for f in result.findings if f.severity == "dangerous"]


def _tar_file(tmp_path: Path, storages: bytes, sys_info: bytes | None = None) -> Path:
    """A tar-format checkpoint of one float tensor whose ``storages`` member is replaced."""
    fixture = Path(__file__).parents[2] / "fixtures" / "tar_format.pt"
    path = tmp_path / "tar.pt"
    with tarfile.open(fixture) as legacy, tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as out:
        for member in legacy.getmembers():
            data = legacy.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == "storages":
                data = storages
            elif member.name == "sys_info" and sys_info is not None:
                data = sys_info
            info = tarfile.TarInfo(member.name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return path


def test_a_tar_payload_after_a_long_count_pickle_is_dangerous(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    padding = b"X" + (100).to_bytes(4, "little") + b"a" * 100 + b"0"  # BINUNICODE, POP
    no_byte_order = b"\x80\x02}(X\x0d\x00\x00\x00little_endian\x89u."
    path = _tar_file(tmp_path, b"\x80\x02" + padding + b"K\x01." + _touch(marker), no_byte_order)
    assert _torch_runs(path, marker)
    (result,) = scan([path]).files
    assert result.verdict == "dangerous"
    assert _dangerous(result) == [("builtins.open", "storages 2")]


def test_a_tar_payload_behind_a_frame_of_an_unbuffered_member_is_dangerous(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    # torch reads the member unbuffered: the count's FRAME is read whole, the decoy skipped.
    decoy = pickle.dumps(("0", "cpu", torch.FloatStorage), 2) + struct.pack("<q", 0)
    path = _tar_file(tmp_path, _framed(b"K\x01." + decoy, 200) + _touch(marker))
    assert _torch_runs(path, marker)
    (result,) = scan([path]).files
    assert result.verdict == "dangerous"
    # Named by the walk, in the pickle torch runs it from (not by the reader's "main pickle").
    assert _dangerous(result) == [("builtins.open", "storages 2")]


def test_a_tar_storage_is_sized_by_the_header_tuple_element(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # The header imports DoubleStorage last, but its storage type (the tuple's third
    # element) is FloatStorage: 2 elements are 8 bytes, and the payload follows them.
    header = b"\x80\x02X\x01\x00\x00\x000X\x03\x00\x00\x00cpuctorch\nFloatStorage\n\x87q\x00"
    header += b"ctorch\nDoubleStorage\n0."
    storage = header + struct.pack("<q", 2) + b"\x00" * 8
    path = _tar_file(tmp_path, pickle.dumps(1, 2) + storage + _touch(marker))
    assert _torch_runs(path, marker)
    (result,) = scan([path]).files
    assert result.verdict == "dangerous"
    assert _dangerous(result) == [("builtins.open", "storages 3")]
