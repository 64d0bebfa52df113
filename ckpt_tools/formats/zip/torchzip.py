"""Reading torch zip archives (``torch.save`` since 1.6, and TorchScript archives).

Only the central directory, the local headers, ``data.pkl`` and the small records torch
reads and parses (versions, byte order, alignment, serialization id) are read, each checked
as torch checks it; stored storage records are located, never loaded (torch checks no
CRC-32 when it loads, so neither does inspect); compressed ones are inflated once, without
keeping their bytes, because torch refuses one that does not inflate to its size, and again
into a temporary copy when their bytes are read.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.base import Checkpoint, RangeSource, ZipRecord
from ckpt_tools.formats.pickle.unpickler import MAX_PICKLE_BYTES, ReadResult, load_pickle
from ckpt_tools.formats.zip.directory import (
    ZipEntry,
    ZipSource,
    located,
    read_zip_directory,
)
from ckpt_tools.formats.zip.inflated import InflatedCopies
from ckpt_tools.formats.zip.records import read_entry
from ckpt_tools.formats.zip.torch_records import (
    RecordLookup,
    check_load_records,
    check_reader_records,
    check_serialization_id,
    check_storage_records,
)

__all__ = ["ArchiveContents", "open_torch_zip", "read_torch_archive"]

# torch.load hands an archive with this record to torch.jit.load (``_is_torchscript_zip``),
# which ``weights_only=True`` refuses; nothing else makes an archive TorchScript to torch.
_TORCHSCRIPT_MARKER = "constants.pkl"


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


class ArchiveContents(NamedTuple):
    """What :func:`read_torch_archive` found: the format, the pickle's result, the records."""

    format: str
    result: ReadResult
    records: dict[str, ZipRecord]
    root: str
    # The records as the directory declares them, by name inside the root folder.
    entries: Mapping[str, ZipEntry] = {}
    # What its byteorder record says (``little`` without one, and for TorchScript).
    byteorder: str = "little"
    # Whether it has that record (without one, torch.load follows its default endianness).
    byteorder_recorded: bool = False


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
    lookup = RecordLookup(path, entries, root)
    serialization_id = check_reader_records(path, fd, lookup)
    # Decided only now, on an archive torch's reader opens, and as torch.load decides: by
    # the exact name in the list of records, not by a lookup.
    is_script = any(e.name == f"{root}/{_TORCHSCRIPT_MARKER}" for e in entries)
    fmt = "torchscript" if is_script else "torch-zip"
    recorded = None
    if fmt == "torch-zip":
        recorded = check_load_records(path, fd, lookup)
    elif "data.pkl" not in lookup:
        raise CorruptCheckpointError(
            f"{path!r} is a TorchScript archive without data.pkl", path=path
        )
    payload = read_entry(path, fd, lookup["data.pkl"], MAX_PICKLE_BYTES)
    result = load_pickle(io.BytesIO(payload))
    records = _records(entries, root)
    check_storage_records(path, fd, result.storages, lookup, inflate=not defer_local)
    if fmt == "torch-zip" and not result.unsafe_globals:
        # (torch refuses an unsafe global first, while unpickling: that refusal stands.)
        check_serialization_id(path, serialization_id)
    cut = len(root) + 1
    entries_by_name = {e.name[cut:]: e for e in entries}
    byteorder = recorded or "little"
    return ArchiveContents(
        fmt, result, records, root, entries_by_name, byteorder, recorded is not None
    )


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
    locate, probe = _locator(path, records, contents.entries, source)
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
        probe=probe,
        byteorder=contents.byteorder,
        byteorder_recorded=contents.byteorder_recorded,
    )


def _locator(
    path: str,
    records: Mapping[str, ZipRecord],
    entries: Mapping[str, ZipEntry],
    source: RangeSource | None,
) -> tuple[Callable[[StorageRef], ByteSpan], Callable[[StorageRef], None]]:
    """Where a storage's bytes lie: its record's data, or a compressed record's inflated copy
    (:class:`~ckpt_tools.formats.zip.inflated.InflatedCopies`); a remote record's local header is
    read and checked the first time (the read that was deferred). And the check alone: a
    local compressed record was inflated and measured when the archive was opened."""
    found: dict[str, int] = {}
    copies = InflatedCopies(path, source)

    def data_offset(record: ZipRecord) -> int:
        if record.data_offset < 0 and source is not None:
            if record.name not in found:
                found[record.name] = located(path, source, entries[record.name]).data_offset
            return found[record.name]
        return record.data_offset

    def locate(storage: StorageRef) -> ByteSpan:
        record = records[f"data/{storage.key}"]
        if record.compressed:
            return copies.span(entries[record.name])
        return ByteSpan(path, data_offset(record), storage.nbytes)

    def probe(storage: StorageRef) -> None:
        data_offset(records[f"data/{storage.key}"])

    return locate, probe
