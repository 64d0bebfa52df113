"""Reading torch zip archives (``torch.save`` since 1.6, and TorchScript archives).

Only the central directory, the local headers, ``data.pkl`` and the small records torch
reads and parses (versions, byte order, alignment, serialization id) are read, each checked
as torch checks it; stored storage records are located, never loaded (torch checks no
CRC-32 when it loads, so neither does inspect); compressed ones are inflated once, without
keeping their bytes, because torch refuses one that does not inflate to its size.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import NamedTuple

from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.formats.pickles import MAX_PICKLE_BYTES, ReadResult, load_pickle
from ckpt_tools.formats.zipdir import FileSlice, ZipEntry, read_zip_directory
from ckpt_tools.formats.ziprecords import check_inflates, read_entry

__all__ = ["ArchiveContents", "open_torch_zip", "read_torch_archive"]

# torch.load hands an archive with this record to torch.jit.load (``_is_torchscript_zip``),
# which ``weights_only=True`` refuses; nothing else makes an archive TorchScript to torch.
_TORCHSCRIPT_MARKER = "constants.pkl"
# torch's reader (caffe2 PyTorchStreamReader) reads ``.data/version`` if present, else
# ``version``, parses it with std::stoull into an int64 and accepts only this range
# (kMinSupportedFileFormatVersion .. kMaxSupportedFileFormatVersion).
_VERSION_RECORDS = (".data/version", "version")
_MIN_VERSION, _MAX_VERSION = 1, 10
_C_SPACE = b" \t\n\v\f\r"
# The small bookkeeping records torch reads whole; torch.save writes at most 40 bytes.
_SMALL_RECORD = 1 << 16


def _archive_root(entries: list[ZipEntry], path: str) -> str:
    """The folder torch reads from: the first record's top folder (as PyTorchStreamReader).

    A record outside that folder is invisible to torch; a ``data.pkl`` there would be read
    by a reader that looked for it elsewhere, so any such record is refused.
    """
    if not entries:
        raise CorruptCheckpointError(f"{path!r} is a zip archive without records", path=path)
    root, slash, _ = entries[0].name.partition("/")
    if not slash or not root:
        raise CorruptCheckpointError(
            f"{path!r}: its first record {entries[0].name!r} is not in a folder, so torch "
            "cannot read it",
            path=path,
        )
    outside = [e.name for e in entries if not e.name.startswith(root + "/")]
    if outside:
        raise CorruptCheckpointError(
            f"{path!r}: records {', '.join(map(repr, outside[:3]))} lie outside the archive "
            f"folder {root!r}, which torch ignores; the archive is ambiguous",
            path=path,
        )
    return root


def _records(entries: list[ZipEntry], root: str) -> dict[str, ZipRecord]:
    return {
        e.name[len(root) + 1 :]: ZipRecord(
            name=e.name[len(root) + 1 :],
            data_offset=e.data_offset,
            size=e.file_size,
            crc32=e.crc32,
            compressed=e.compressed,
            header_offset=e.header_offset,
        )
        for e in entries
        if not e.name.endswith("/")
    }


def _stoull_int64(text: bytes) -> int | None:
    """``(int64_t) std::stoull(text)``: None where stoull finds no number (torch's message).

    Leading C whitespace, an optional sign, then decimal digits up to the first other
    character (or NUL); a minus negates modulo 2**64, as strtoull does.

    Example:
        >>> [_stoull_int64(t) for t in (b" +3abc", b"-1", b"abc", b"18446744073709551615")]
        [3, -1, None, -1]
    """
    text = text.split(b"\0", 1)[0].lstrip(_C_SPACE)
    sign = -1 if text[:1] == b"-" else 1
    text = text[1:] if text[:1] in (b"-", b"+") else text
    digits = len(text) - len(text.lstrip(b"0123456789"))
    if not digits:
        return None
    value = int(text[:digits])
    if value >= 1 << 64:
        raise OverflowError("stoull")
    value = (sign * value) % (1 << 64)
    return value - (1 << 64) if value >= 1 << 63 else value


def _check_reader_records(
    path: str, fd: int | FileSlice, entries: dict[str, ZipEntry]
) -> bytes | None:
    """What torch's reader checks when it opens any torch zip, TorchScript or not.

    Returns the serialization id record's bytes (None without one).
    """
    listing = ", ".join(list(entries)[:5]) + (" ..." if len(entries) > 5 else "")
    id_entry = entries.get(".data/serialization_id")
    serialization_id = None if id_entry is None else _read_small(path, fd, id_entry)
    name = next((n for n in _VERSION_RECORDS if n in entries), None)
    if name is None:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a version record, so it is not a torch "
            f"archive torch.load reads (records: {listing})",
            path=path,
        )
    text = _read_small(path, fd, entries[name])
    try:
        version = _stoull_int64(text)
    except OverflowError as e:
        raise CorruptCheckpointError(
            f"{path!r}: its {name} record {text[:24]!r} is out of range (torch refuses it)",
            path=path,
        ) from e
    if version is None or not _MIN_VERSION <= version <= _MAX_VERSION:
        raise CorruptCheckpointError(
            f"{path!r}: its {name} record {text[:24]!r} is not a file format version torch "
            f"reads ({_MIN_VERSION} to {_MAX_VERSION}); torch refuses the archive",
            path=path,
        )
    return serialization_id


def _check_serialization_id(path: str, serialization_id: bytes | None) -> None:
    """torch.load ends by handing the serialization id to Python as str: it must be UTF-8."""
    if serialization_id is None:
        return
    try:
        serialization_id.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(
            f"{path!r}: its .data/serialization_id record is not UTF-8 text ({e.reason} at "
            f"byte {e.start}); torch.load fails on it after unpickling",
            path=path,
        ) from e


def _check_load_records(path: str, fd: int | FileSlice, entries: dict[str, ZipEntry]) -> None:
    """What ``torch.serialization._load`` reads and parses before data.pkl, parsed as it does."""
    listing = ", ".join(list(entries)[:5]) + (" ..." if len(entries) > 5 else "")
    if "data.pkl" not in entries:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a data.pkl record, so it is not a torch "
            f"archive torch.load reads (records: {listing})",
            path=path,
        )
    if ".format_version" in entries:
        _read_small(path, fd, entries[".format_version"])  # compared as bytes: any value
    order = entries.get("byteorder")
    if order is not None:
        value = _read_small(path, fd, order)
        if value == b"big":
            raise UnsupportedFormatError(
                f"{path!r} was saved big-endian (torch.load byte-swaps it on loading); load "
                "it with torch.load and save it again",
                path=path,
            )
        if value != b"little":
            raise CorruptCheckpointError(
                f"{path!r}: its byteorder record is {value[:16]!r}, not little or big", path=path
            )
    alignment = entries.get(".storage_alignment")
    if alignment is not None:
        value = _read_small(path, fd, alignment)
        try:
            int(value)  # exactly torch's parse: int(zip_file.get_record(".storage_alignment"))
        except ValueError as e:
            raise CorruptCheckpointError(
                f"{path!r}: its .storage_alignment record {value[:24]!r} is not an integer "
                "(torch refuses the archive)",
                path=path,
            ) from e


def _read_small(path: str, fd: int | FileSlice, entry: ZipEntry) -> bytes:
    return read_entry(path, fd, entry, _SMALL_RECORD)


def _check_storage_records(
    path: str,
    fd: int | FileSlice,
    storages: Mapping[str, StorageRef],
    records: Mapping[str, ZipRecord],
    entries: Mapping[str, ZipEntry],
) -> None:
    """Every storage record torch.load would read exists, has the size it needs, and reads.

    A stored record is only located (its headers were checked with the directory); a
    compressed one is inflated, in bounded pieces, as torch inflates it when it loads.
    """
    for storage in storages.values():
        if storage.view is not None:
            # torch.load's zip reader unpacks exactly five fields and fails on a view's sixth;
            # reading on would place the view's tensors in its root storage's bytes.
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} is a legacy storage view, which a zip "
                "archive cannot hold (torch.load refuses it too)"
            )
        record = records.get(f"data/{storage.key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{path!r}: the pickle refers to storage {storage.key!r} but the archive has no "
                f"record data/{storage.key}"
            )
        if record.size != storage.nbytes:
            # torch.load refuses both ways ("record size does not match expected size").
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} needs {storage.nbytes} bytes, its record "
                f"holds {record.size}",
                path=path,
            )
        if record.compressed:
            check_inflates(path, fd, entries[f"data/{storage.key}"])


class ArchiveContents(NamedTuple):
    """What :func:`read_torch_archive` found: the format, the pickle's result, the records."""

    format: str
    result: ReadResult
    records: dict[str, ZipRecord]
    root: str


def read_torch_archive(path: str, fd: int | FileSlice, size: int) -> ArchiveContents:
    """Read and check a torch zip archive open as ``fd`` (or embedded in a file: a FileSlice).

    Args:
        path: the file, for messages.
        fd: its open descriptor, or the slice of one that holds the archive (record offsets
            are then relative to the slice, as torch reads DCP chunks).
        size: the archive's size in bytes.

    Returns:
        The format (``torch-zip`` or ``torchscript``), the pickle's tree and the records.

    Raises:
        CorruptCheckpointError: not a valid torch archive, or truncated.
        ResourceLimitError: ``data.pkl`` is implausibly large.
    """
    entries = read_zip_directory(path, fd, size)
    root = _archive_root(entries, path)
    by_name = {e.name[len(root) + 1 :]: e for e in entries}
    serialization_id = _check_reader_records(path, fd, by_name)
    # Decided only now, on an archive torch's reader opens, and as torch.load decides.
    fmt = "torchscript" if _TORCHSCRIPT_MARKER in by_name else "torch-zip"
    if fmt == "torch-zip":
        _check_load_records(path, fd, by_name)
    elif "data.pkl" not in by_name:
        raise CorruptCheckpointError(
            f"{path!r} is a TorchScript archive without data.pkl", path=path
        )
    payload = read_entry(path, fd, by_name["data.pkl"], MAX_PICKLE_BYTES)
    result = load_pickle(io.BytesIO(payload))
    records = _records(entries, root)
    _check_storage_records(path, fd, result.storages, records, by_name)
    if fmt == "torch-zip" and not result.unsafe_globals:
        # (torch refuses an unsafe global first, while unpickling: that refusal stands.)
        _check_serialization_id(path, serialization_id)
    return ArchiveContents(fmt, result, records, root)


def open_torch_zip(path: str) -> Checkpoint:
    """Open a torch zip archive (``torch.save`` or ``torch.jit.save``) without loading tensors.

    Args:
        path: the archive.

    Returns:
        A :class:`Checkpoint` of format ``torch-zip`` or ``torchscript``.

    Raises:
        CorruptCheckpointError: not a valid torch archive, or truncated.
        ResourceLimitError: ``data.pkl`` is implausibly large.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        contents = read_torch_archive(path, fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    fmt, result, records, root = (
        contents.format,
        contents.result,
        contents.records,
        contents.root,
    )

    def locate(storage: StorageRef) -> ByteSpan:
        record = records[f"data/{storage.key}"]
        if record.compressed:
            raise CorruptCheckpointError(
                f"{path!r}: record data/{storage.key} is compressed; torch writes storages "
                "stored, so this archive was re-zipped: re-save it with torch.save"
            )
        return ByteSpan(path, record.data_offset, storage.nbytes)

    return Checkpoint(
        path=path,
        format=fmt,
        root=result.root,
        storages=result.storages,
        unsafe_globals=result.unsafe_globals,
        protocol=result.protocol,
        beyond_weights_only=result.beyond_weights_only,
        records=records,
        archive_root=root,
        locate=locate,
    )
