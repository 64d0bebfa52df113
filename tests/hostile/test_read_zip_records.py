"""The zip records torch's reader checks and torch.load parses, checked the same way.

torch opens a zip archive with caffe2's PyTorchStreamReader (miniz underneath): it checks
every central entry, reads ``.data/serialization_id`` and the file format version
(``.data/version`` or ``version``, parsed by std::stoull, 1 to 10), and only then decides
whether the archive is TorchScript (``constants.pkl``). ``torch.serialization._load`` then
reads ``.format_version``, ``byteorder`` and ``.storage_alignment`` (``int()``) and inflates
every compressed storage record it loads. Each test builds such an input in ``tmp_path``
and asks torch itself (``weights_only=True``) for the verdict we must match: read the same,
or refuse with one line and exit 4. torch does not check CRC-32s when it reads, so a wrong
CRC on a storage record is no reason to refuse (inspect never reads tensor bytes).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.zip.directory import FileSlice, read_zip_directory
from tests.helpers.child_oracle import json_per_path

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}


def _rebuilt(src: Path, dst: Path, replace: dict[str, bytes], **kw: int) -> Path:
    """``src``'s records with some values replaced (or added, after the first record)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", **kw) as zout:
        infos = zin.infolist()
        root = infos[0].filename.split("/")[0]
        todo = dict(replace)
        for info in infos:
            name = info.filename[len(root) + 1 :]
            zout.writestr(info.filename, todo.pop(name, None) or zin.read(info.filename))
        for name, value in todo.items():
            zout.writestr(f"{root}/{name}", value)
    return dst


def _lie_stored_size(path: Path, suffix: str, dst: Path) -> Path:
    """Declare 1 compressed byte for a stored record, its time zeroed as torch.save writes it.

    (miniz checks a stored entry's two sizes only when its method and time are both zero.)
    """
    data = bytearray(path.read_bytes())
    central = _central(data, suffix)
    struct.pack_into("<HH", data, central + 10, 0, 0)  # method, modification time
    struct.pack_into("<L", data, central + 20, 1)  # compressed size
    dst.write_bytes(data)
    return dst


def _central(data: bytes | bytearray, suffix: str) -> int:
    """The offset of the central directory entry whose name ends with ``suffix``."""
    at = struct.unpack_from("<L", data, data.rfind(b"PK\x05\x06") + 16)[0]
    while data[at : at + 4] == b"PK\x01\x02":
        n, e, c = struct.unpack_from("<3H", data, at + 28)
        if data[at + 46 : at + 46 + n].decode().endswith(suffix):
            return at
        at += 46 + n + e + c
    raise KeyError(suffix)


def _set_in_both_headers(path: Path, fmt: str, central: int, local: int, value: int) -> None:
    """Set one field of data/0's central entry (at ``central``) and local header (``local``)."""
    data = bytearray(path.read_bytes())
    entry = _central(data, "data/0")
    header = struct.unpack_from("<L", data, entry + 42)[0]
    struct.pack_into(fmt, data, entry + central, value)
    struct.pack_into(fmt, data, header + local, value)
    path.write_bytes(data)


def _torch_reads(path: Path) -> bool:
    try:
        torch.load(path, weights_only=True)
    except Exception:
        return False
    return True


def _inspect(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPT, "inspect", str(path)], capture_output=True, text=True, timeout=60)


def _agrees_with_torch(path: Path, words: str = "") -> None:
    """We read ``path`` iff torch does; a refusal is one CorruptCheckpointError line, exit 4."""
    result = _inspect(path)
    if _torch_reads(path):
        assert open_checkpoint(path).format == "torch-zip"
        assert result.returncode == 0, result.stderr
        return
    with pytest.raises(CorruptCheckpointError, match=words):
        open_checkpoint(path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 4, result.stderr
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.stderr


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "plain.pt"
    torch.save(_state(), path)
    return path


@pytest.mark.parametrize(
    ("record", "value"),
    [
        ("version", b"abc"),
        ("version", b""),
        ("version", b"0"),
        ("version", b"11"),
        ("version", b"-1"),
        ("version", b"0x3"),
        ("version", b"99999999999999999999999"),
        ("version", b" +3abc"),  # stoull reads 3
        ("version", b"\n10"),
        (".data/version", b"11"),  # overrides a valid version record
        (".data/version", b"2"),
        (".storage_alignment", b"6\n6\n6"),
        (".storage_alignment", b"\xff"),
        (".storage_alignment", b" 64\n"),  # int() reads 64
        (".storage_alignment", b"1_0"),
        ("byteorder", b"LITTLE"),
        (".format_version", b"\xff\x00"),  # compared as bytes, never parsed
        (".data/serialization_id", b"caf\xc3\xa9"),
        (".data/serialization_id", b"\xff" * 3),  # handed to Python as str: not UTF-8
    ],
)
def test_parsed_records_read_as_torch_parses_them(saved, tmp_path, record, value):
    path = _rebuilt(saved, tmp_path / "in.pt", {record: value})
    _agrees_with_torch(path, record.lstrip("."))


def test_stored_record_with_two_sizes_is_corrupt_even_when_unreferenced(saved, tmp_path):
    # miniz refuses the whole archive at open when a stored entry's sizes differ.
    path = _rebuilt(saved, tmp_path / "in.pt", {"extra/notes.txt": b"0123456789"})
    path = _lie_stored_size(path, "extra/notes.txt", tmp_path / "lie.pt")
    with pytest.raises(RuntimeError, match="corrupted"):
        torch.load(path, weights_only=True)
    _agrees_with_torch(path, "declares 1 bytes compressed")


def test_torchscript_is_decided_only_on_an_archive_torch_opens(saved, tmp_path):
    marked = _rebuilt(saved, tmp_path / "ts.pt", {"constants.pkl": b"\x80\x02).", "code/x.py": b""})
    with pytest.raises(RuntimeError, match="TorchScript"):
        torch.load(marked, weights_only=True)
    assert open_checkpoint(marked).format == "torchscript"
    # The same archive with one lying central size: torch's reader refuses it as corrupt.
    broken = _lie_stored_size(marked, "data/0", tmp_path / "broken.pt")
    with pytest.raises(RuntimeError, match="corrupted"):
        torch.load(broken, weights_only=True)
    _agrees_with_torch(broken, "declares 1 bytes compressed")
    # A version torch's reader refuses: refused before the TorchScript question is asked.
    _agrees_with_torch(_rebuilt(marked, tmp_path / "v.pt", {"version": b"abc"}), "version")


def test_compressed_storage_inflating_short_is_refused(saved, tmp_path):
    # data/0 deflated from 40 of its 48 bytes, its declared size set back to 48: torch
    # inflates it when loading and refuses it ("unexpected decompressed size").
    with zipfile.ZipFile(saved) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/data/0"))
        short = archive.read(name)[:40]
    path = _rebuilt(saved, tmp_path / "in.pt", {"data/0": short}, compression=zipfile.ZIP_DEFLATED)
    _set_in_both_headers(path, "<L", 24, 22, 48)  # the uncompressed size
    with pytest.raises(RuntimeError, match="unexpected decompressed size"):
        torch.load(path, weights_only=True)
    _agrees_with_torch(path, "does not inflate")
    good = _rebuilt(saved, tmp_path / "deflated.pt", {}, compression=zipfile.ZIP_DEFLATED)
    _agrees_with_torch(good)


def test_compressed_storage_that_is_no_deflate_stream_is_refused(saved, tmp_path):
    # Stored bytes marked deflated. torch's miniz fails to inflate them without setting an
    # error, and torch returns the tensor's uninitialized memory: nothing we could read the
    # same, so the file is refused.
    path = _rebuilt(saved, tmp_path / "in.pt", {})
    _set_in_both_headers(path, "<H", 10, 8, 8)  # the method: deflated
    with pytest.raises(CorruptCheckpointError, match="does not inflate"):
        open_checkpoint(path)
    result = _inspect(path)
    assert result.returncode == 4 and len(result.stderr.strip().splitlines()) == 1


def test_storage_crc_is_not_checked_because_torch_does_not(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    struct.pack_into("<L", data, _central(data, "data/0") + 16, 0x12345678)
    path = tmp_path / "crc.pt"
    path.write_bytes(data)
    assert _torch_reads(path)
    _agrees_with_torch(path)


def test_rewrites_write_parsed_records_as_torch_save_does(tmp_path):
    wrapped = {f"module.{k}": v for k, v in _state().items()}
    src = tmp_path / "wrapped.pt"
    torch.save(wrapped, src)
    odd = {".storage_alignment": b" 4096\n", "version": b" +10x", ".data/version": b"9"}
    src = _rebuilt(src, tmp_path / "odd.pt", odd)
    assert _torch_reads(src)
    dst = tmp_path / "out.pt"
    result = subprocess.run(
        [CKPT, "strip-module", str(src), str(dst)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    with zipfile.ZipFile(dst) as archive:
        root = archive.namelist()[0].split("/")[0]
        read = {n[len(root) + 1 :]: archive.read(n) for n in archive.namelist()}
    assert read[".storage_alignment"] == b"64" and read["version"] == b"3\n"
    # Python's zipfile rebuilt the source: its records do not lie as torch's writer lays
    # them, so the output does not let torch compute their offsets.
    assert read[".format_version"] == b"0" and read["byteorder"] == b"little"
    assert ".data/version" not in read
    loaded = torch.load(dst, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in _state().items())


def test_full_verify_finds_a_wrong_storage_crc_the_copy_carried(tmp_path):
    # Records are copied without reading them, with the source's CRC-32; torch never checks
    # CRCs, so only --verify full (which reads every byte anyway) can tell. (Small records'
    # CRCs, up to 1 MiB, are checked by every verification; this storage is 2 MiB.)
    src = tmp_path / "wrapped.pt"
    torch.save({"module.w": torch.arange(1 << 19, dtype=torch.float32)}, src)
    data = bytearray(src.read_bytes())
    struct.pack_into("<L", data, _central(data, "data/0") + 16, 0x12345678)
    src.write_bytes(data)
    assert _torch_reads(src)
    command = [CKPT, "strip-module", str(src), str(tmp_path / "out.pt"), "--verify"]
    ok = subprocess.run([*command, "sizes"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    full = subprocess.run(
        [*command, "full", "--force"], capture_output=True, text=True, timeout=120
    )
    lines = full.stderr.strip().splitlines()
    assert full.returncode != 0 and len(lines) == 1 and "CRC-32" in lines[0], full.stderr


def test_legacy_file_written_with_protocol_4_is_detected_as_legacy(tmp_path):
    # torch's legacy reader unpickles the first object (PROTO 4, FRAME, the magic number)
    # whatever the protocol; detection asks the same question, not a byte pattern.
    from ckpt_tools.formats.detect import detect_format

    path = tmp_path / "legacy4.pt"
    torch.save(_state(), path, _use_new_zipfile_serialization=False, pickle_protocol=4)
    assert path.read_bytes()[2:3] == b"\x95"  # FRAME
    assert detect_format(path) == "torch-legacy"
    assert len(open_checkpoint(path).storages) == len(_state())
    assert _inspect(path).returncode == 0


def _far_local_header(src: Path, dst: Path, suffix: str, offset: int) -> Path:
    """``src`` with ``suffix``'s local header moved to a zip64 ``offset`` (central entry only).

    The central entry's 32-bit offset becomes 0xFFFFFFFF and a zip64 extra field carries the
    real one; the directory grows by that field, so its size in both end records and the zip64
    end record's place in the locator move with it, and nothing else changes.
    """
    data = bytearray(src.read_bytes())
    central = _central(data, suffix)
    name_len, extra_len = struct.unpack_from("<2H", data, central + 28)
    assert extra_len == 0  # as torch.save writes its central entries
    extra = struct.pack("<2HQ", 1, 8, offset)
    struct.pack_into("<H", data, central + 30, len(extra))
    struct.pack_into("<L", data, central + 42, 0xFFFFFFFF)
    data[central + 46 + name_len : central + 46 + name_len] = extra
    zip64_end = data.rfind(b"PK\x06\x06")
    locator, end = data.rfind(b"PK\x06\x07"), data.rfind(b"PK\x05\x06")
    struct.pack_into(
        "<Q", data, zip64_end + 40, struct.unpack_from("<Q", data, zip64_end + 40)[0] + 12
    )
    struct.pack_into("<Q", data, locator + 8, zip64_end)
    if struct.unpack_from("<L", data, end + 12)[0] != 0xFFFFFFFF:
        struct.pack_into("<L", data, end + 12, struct.unpack_from("<L", data, end + 12)[0] + 12)
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize(
    "where",
    ["the directory's start", "past the file", "past off_t (2**63 + 5)", "2**64 - 1"],
)
def test_a_local_header_declared_past_the_records_is_missing_not_a_crash(saved, tmp_path, where):
    # A zip64 offset can exceed what os.pread and posix_fadvise take (off_t): 2**63 + 5 must
    # be a missing record, not an OverflowError traceback from the prefetch.
    directory = struct.unpack_from(
        "<Q", saved.read_bytes(), saved.read_bytes().rfind(b"PK\x06\x06") + 48
    )[0]
    offset = {
        "the directory's start": directory,
        "past the file": saved.stat().st_size + 4096,
        "past off_t (2**63 + 5)": 2**63 + 5,
        "2**64 - 1": 2**64 - 1,
    }[where]
    path = _far_local_header(saved, tmp_path / "far.pt", "data.pkl", offset)
    with zipfile.ZipFile(path) as z:  # the mutation is the one intended, seen by another reader
        assert z.getinfo(z.namelist()[0]).header_offset == offset
    assert not _torch_reads(path)
    _agrees_with_torch(path, "local header of record")


def test_a_far_local_header_inside_a_file_slice_is_missing_not_a_crash(saved, tmp_path):
    # A DCP .distcp file holds one archive per chunk, each read through a FileSlice.
    archive = _far_local_header(saved, tmp_path / "far.pt", "data.pkl", 2**63 + 5).read_bytes()
    outer = tmp_path / "outer.distcp"
    outer.write_bytes(b"x" * 100 + archive + b"y" * 50)
    fd = os.open(outer, os.O_RDONLY)
    try:
        with pytest.raises(CorruptCheckpointError, match=r"local header of record .* is missing"):
            read_zip_directory(str(outer), FileSlice(fd, 100, len(archive)), len(archive))
    finally:
        os.close(fd)


def test_a_local_header_may_end_where_the_directory_starts_not_a_byte_later(saved, tmp_path):
    # The bound is exact, with no byte to spare: an empty last
    # record, as `zipfile` writes one, has its local header end at the directory's first byte.
    path = tmp_path / "adjacent.pt"
    with zipfile.ZipFile(saved) as zin, zipfile.ZipFile(path, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
        zout.writestr(f"{zin.namelist()[0].split('/')[0]}/zz_empty", b"")
    with zipfile.ZipFile(path) as z:
        last = z.infolist()[-1]
        assert last.header_offset + 30 + len(last.filename) == z.start_dir
    assert _torch_reads(path)
    _agrees_with_torch(path)
    # One byte later it overlaps the directory. torch never reads that record, so it loads
    # the file; we refuse a record we cannot read, whoever reads it, and by the bound itself
    # (the header read would refuse it too, for its signature, in other words).
    data = bytearray(path.read_bytes())
    struct.pack_into("<L", data, _central(data, "zz_empty") + 42, last.header_offset + 1)
    later = tmp_path / "later.pt"
    later.write_bytes(bytes(data))
    words = f"declared at offset {last.header_offset + 1}, past the start of the central"
    with pytest.raises(CorruptCheckpointError, match=words):
        open_checkpoint(later)
    result = _inspect(later)
    assert result.returncode == 4 and "Traceback" not in result.stderr


def test_compressed_bytes_beyond_what_deflate_needs_are_refused_unread(tmp_path: Path) -> None:
    """A record that declares far more compressed bytes than its size could need (a stream
    padded with a megabyte): refused from its sizes, before those bytes are read."""
    import zlib

    from ckpt_tools.formats.zip.directory import ZipEntry
    from ckpt_tools.formats.zip.records import deflate_bound, read_entry

    payload = b"\x80\x02}q\x00."
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    stream = packer.compress(payload) + packer.flush()
    target = tmp_path / "padded.bin"
    target.write_bytes(stream + bytes(1 << 20))
    padded = ZipEntry(
        "archive/data.pkl", 0, len(stream) + (1 << 20), len(payload), zlib.crc32(payload), True
    )
    exact = padded._replace(compress_size=len(stream))
    fd = os.open(target, os.O_RDONLY)
    try:
        assert read_entry(str(target), fd, exact, 1 << 20) == payload
        assert len(stream) <= deflate_bound(len(payload)) < padded.compress_size
        with pytest.raises(CorruptCheckpointError, match="more than deflate ever needs"):
            read_entry(str(target), fd, padded, 1 << 20)
    finally:
        os.close(fd)


_SAVE_ELSEWHERE = (
    "import sys, torch; torch.manual_seed(7); torch.save({'w': torch.randn(1024)}, sys.argv[1])"
)


@pytest.fixture(scope="module")
def saved_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch file saved in another process: torch fills no byte of a folder's record, so
    the storage it reads holds what its memory held, and memory this process freed after
    saving the same values could be it."""
    src = tmp_path_factory.mktemp("elsewhere") / "plain.pt"
    subprocess.run([sys.executable, "-c", _SAVE_ELSEWHERE, str(src)], check=True)
    return src


_FOLDER_BIT_ORACLE = """
import json, sys, torch
try:
    loaded = torch.load(sys.argv[1], weights_only=True)["w"]
    right = torch.equal(loaded, torch.randn(1024, generator=torch.Generator().manual_seed(7)))
except Exception:  # the oracle refusing, whatever its type
    right = False
print(json.dumps({"right": right}))
"""


@pytest.mark.parametrize("record", ["data/0", "data.pkl", "version"])
def test_a_record_marked_as_a_folder_is_refused(
    saved_elsewhere: Path, tmp_path: Path, record: str
) -> None:
    src, path = saved_elsewhere, tmp_path / "folder_bit.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if info.filename.endswith("/" + record):
                info.external_attr |= 0x10  # the MS-DOS folder bit miniz reads
            zout.writestr(info, zin.read(info.filename))
    # torch reads the record as empty: wrong values, or a pickle it cannot read. Asked in a
    # process that never held the right values (a storage torch leaves unfilled is whatever
    # its memory held, and this one just copied them).
    assert json_per_path(_FOLDER_BIT_ORACLE, path) == [{"right": False}]
    with pytest.raises(CorruptCheckpointError, match=f"{record}' is marked as a folder"):
        open_checkpoint(path)
