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
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.base import Checkpoint, RangeSource, ZipRecord
from ckpt_tools.formats.pickle.unpickler import MAX_PICKLE_BYTES, ReadResult, load_pickle
from ckpt_tools.formats.zip.directory import (
    ZipEntry,
    ZipSource,
    located,
    read_zip_directory,
)
from ckpt_tools.formats.zip.records import check_inflates, read_entry

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

    torch.load lists every record when it opens an archive and refuses one outside that
    folder (compared exactly, case included); so do we.
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
            f"folder {root!r} (named by its first record); torch.load refuses such an archive",
            path=path,
        )
    return root


class _Lookup:
    """The records of an archive found by name as torch's reader finds them.

    torch's reader (miniz's ``mz_zip_reader_locate_file``, a binary search over the names
    sorted without regard to ASCII case) finds ``root/name`` in any case: an archive with
    ``data.pkl`` and ``DATA.PKL`` gives torch one of the two, by the order of the sort.
    So a name torch looks up must match exactly one record, spelled exactly as torch.save
    spells it; anything else is refused, naming the records (torch.save never writes them).
    """

    def __init__(self, path: str, entries: list[ZipEntry], root: str) -> None:
        self._path = path
        self._prefix = f"{root}/"
        self._by_folded: dict[bytes, list[ZipEntry]] = {}
        for entry in entries:
            self._by_folded.setdefault(entry.raw_name.lower(), []).append(entry)

    def find(self, name: str) -> ZipEntry | None:
        """The record torch reads as ``name`` (inside the root folder); None without one.

        Raises:
            CorruptCheckpointError: several records answer to ``name``, or one that is
                spelled otherwise.
        """
        wanted = (self._prefix + name).encode("utf-8", "surrogatepass")
        found = self._by_folded.get(wanted.lower())
        if not found:
            return None
        if len(found) > 1:
            raise CorruptCheckpointError(
                f"{self._path!r}: records {' and '.join(repr(e.name) for e in found[:2])} both "
                f"answer torch's lookup of {name!r} (it ignores case), and torch reads one of "
                "them by the order of its sort: the archive is ambiguous",
                path=self._path,
            )
        if found[0].raw_name != wanted:
            raise CorruptCheckpointError(
                f"{self._path!r}: record {found[0].name!r} is the one torch reads as {name!r} "
                "(its lookup ignores case); torch.save never spells a record so, and a "
                "reader that does not ignore case reads another archive",
                path=self._path,
            )
        return found[0]

    def listing(self) -> str:
        """The first few record names, for messages."""
        names = [e.name for entries in self._by_folded.values() for e in entries]
        return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")

    def __contains__(self, name: str) -> bool:
        return self.find(name) is not None

    def __getitem__(self, name: str) -> ZipEntry:
        found = self.find(name)
        if found is None:
            raise KeyError(name)
        return found


def _records(entries: list[ZipEntry], root: str) -> dict[str, ZipRecord]:
    return {
        e.name[len(root) + 1 :]: ZipRecord(
            name=e.name[len(root) + 1 :],
            data_offset=e.data_offset,
            size=e.file_size,
            crc32=e.crc32,
            compressed=e.compressed,
            header_offset=e.header_offset,
            compress_size=e.compress_size,
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


def _check_reader_records(path: str, fd: ZipSource, entries: _Lookup) -> bytes | None:
    """What torch's reader checks when it opens any torch zip, TorchScript or not.

    Returns the serialization id record's bytes (None without one).
    """
    id_entry = entries.find(".data/serialization_id")
    serialization_id = None if id_entry is None else _read_small(path, fd, id_entry)
    name = next((n for n in _VERSION_RECORDS if n in entries), None)
    if name is None:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a version record, so it is not a torch "
            f"archive torch.load reads (records: {entries.listing()})",
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


def _check_load_records(path: str, fd: ZipSource, entries: _Lookup) -> None:
    """What ``torch.serialization._load`` reads and parses before data.pkl, parsed as it does."""
    if "data.pkl" not in entries:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a data.pkl record, so it is not a torch "
            f"archive torch.load reads (records: {entries.listing()})",
            path=path,
        )
    if ".format_version" in entries:
        _read_small(path, fd, entries[".format_version"])  # compared as bytes: any value
    order = entries.find("byteorder")
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
    alignment = entries.find(".storage_alignment")
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


def _read_small(path: str, fd: ZipSource, entry: ZipEntry) -> bytes:
    return read_entry(path, fd, entry, _SMALL_RECORD)


def _check_storage_records(
    path: str,
    fd: ZipSource,
    storages: Mapping[str, StorageRef],
    entries: _Lookup,
    *,
    inflate: bool = True,
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
        record = entries.find(f"data/{storage.key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{path!r}: the pickle refers to storage {storage.key!r} but the archive has no "
                f"record data/{storage.key}"
            )
        if record.file_size != storage.nbytes:
            # torch.load refuses both ways ("record size does not match expected size").
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} needs {storage.nbytes} bytes, its record "
                f"holds {record.file_size}",
                path=path,
            )
        if record.compressed and inflate:
            check_inflates(path, fd, record)


class ArchiveContents(NamedTuple):
    """What :func:`read_torch_archive` found: the format, the pickle's result, the records."""

    format: str
    result: ReadResult
    records: dict[str, ZipRecord]
    root: str
    # The records as the directory declares them, by name inside the root folder.
    entries: Mapping[str, ZipEntry] = {}


def read_torch_archive(
    path: str, fd: ZipSource, size: int, *, defer_local: bool = False
) -> ArchiveContents:
    """Read and check a torch zip archive open as ``fd`` (or embedded in a file: a FileSlice).

    Args:
        path: the file, for messages.
        fd: its open descriptor, or the slice of one that holds the archive (record offsets
            are then relative to the slice, as torch reads DCP chunks).
        size: the archive's size in bytes.
        defer_local: read a remote file: each record's local header is checked when its
            bytes are read, not now (:func:`~ckpt_tools.formats.zip.directory.located`),
            and a compressed storage record is inflated then too.

    Returns:
        The format (``torch-zip`` or ``torchscript``), the pickle's tree and the records.

    Raises:
        CorruptCheckpointError: not a valid torch archive, or truncated.
        ResourceLimitError: ``data.pkl`` is implausibly large.
    """
    entries = read_zip_directory(path, fd, size, defer_local=defer_local)
    root = _archive_root(entries, path)
    lookup = _Lookup(path, entries, root)
    serialization_id = _check_reader_records(path, fd, lookup)
    # Decided only now, on an archive torch's reader opens, and as torch.load decides: by
    # the exact name in the list of records, not by a lookup.
    is_script = any(e.name == f"{root}/{_TORCHSCRIPT_MARKER}" for e in entries)
    fmt = "torchscript" if is_script else "torch-zip"
    if fmt == "torch-zip":
        _check_load_records(path, fd, lookup)
    elif "data.pkl" not in lookup:
        raise CorruptCheckpointError(
            f"{path!r} is a TorchScript archive without data.pkl", path=path
        )
    payload = read_entry(path, fd, lookup["data.pkl"], MAX_PICKLE_BYTES)
    result = load_pickle(io.BytesIO(payload))
    records = _records(entries, root)
    _check_storage_records(path, fd, result.storages, lookup, inflate=not defer_local)
    if fmt == "torch-zip" and not result.unsafe_globals:
        # (torch refuses an unsafe global first, while unpickling: that refusal stands.)
        _check_serialization_id(path, serialization_id)
    cut = len(root) + 1
    return ArchiveContents(fmt, result, records, root, {e.name[cut:]: e for e in entries})


def open_torch_zip(path: str, *, source: RangeSource | None = None) -> Checkpoint:
    """Open a torch zip archive (``torch.save`` or ``torch.jit.save``) without loading tensors.

    Args:
        path: the archive (its URL where ``source`` is given).
        source: the archive read by ranges (a remote file); None reads ``path``. Its
            records' local headers are then checked when their bytes are located.

    Returns:
        A :class:`Checkpoint` of format ``torch-zip`` or ``torchscript``.

    Raises:
        CorruptCheckpointError: not a valid torch archive, or truncated.
        ResourceLimitError: ``data.pkl`` is implausibly large.
    """
    if source is not None:
        contents = read_torch_archive(path, source, source.size, defer_local=True)
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            contents = read_torch_archive(path, fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    fmt, result, records, root = contents.format, contents.result, contents.records, contents.root
    locate = _locator(path, records, contents.entries, source)
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


def _locator(
    path: str,
    records: Mapping[str, ZipRecord],
    entries: Mapping[str, ZipEntry],
    source: RangeSource | None,
) -> Callable[[StorageRef], ByteSpan]:
    """Where a storage's bytes lie: its record's data; a remote record's local header is read
    and checked the first time (the read that was deferred)."""
    found: dict[str, int] = {}

    def locate(storage: StorageRef) -> ByteSpan:
        record = records[f"data/{storage.key}"]
        if record.compressed:
            raise CorruptCheckpointError(
                f"{path!r}: record data/{storage.key} is compressed; torch writes storages "
                "stored, so this archive was re-zipped: re-save it with torch.save"
            )
        offset = record.data_offset
        if offset < 0 and source is not None:
            if record.name not in found:
                found[record.name] = located(path, source, entries[record.name]).data_offset
            offset = found[record.name]
        return ByteSpan(path, offset, storage.nbytes)

    return locate
