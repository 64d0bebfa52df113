"""Every pickle a checkpoint file holds, found by its format's layout, and walked.

- torch zip (and TorchScript): ``data.pkl`` and every other record that is a pickle by
  content (``torch.package`` archives hold several; any record can hold one), including
  records a name lookup would never reach, but not the storage records ``data.pkl`` names
  (:func:`storage_records`: torch reads those as raw bytes); TorchScript's ``code/`` files
  are listed.
- legacy (pre-1.6): the five pickles torch reads back to back (magic number, protocol,
  ``sys_info``, the main pickle, the storage keys), each where ``pickle.load`` starts it
  (:mod:`~ckpt_tools.ops.scan.sequence`).
- tar (torch < 0.4): the ``sys_info`` and ``pickle`` members, and every pickle of
  ``storages`` and ``tensors``, found as torch reads them
  (:mod:`~ckpt_tools.ops.scan.tar_layout`).
- plain pickles: each pickle that follows the last, to the end of the file.
- DCP: ``.metadata``, and every item's archive in the ``.distcp`` files.
- numpy: the pickle of an ``.npy`` array of objects (also inside an ``.npz`` zip).

Nothing is unpickled here: :func:`~ckpt_tools.formats.pickle.imports.find_imports` walks the
opcodes. Reads are bounded: a record that is not a pickle is told apart by its first bytes.

A remote file (``source``, read by ranges) is walked the same way through its range cache: a
zip's records, whose local headers its reader left unread, each have their header read and
checked before their first bytes are looked at (a request each, as torch reads each record).
"""

from __future__ import annotations

import os
import tarfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from ckpt_tools.errors import CheckpointError, CorruptCheckpointError, RemoteError
from ckpt_tools.formats.base import Checkpoint, RangeFile, RangeSource, open_buffered
from ckpt_tools.formats.detect import check_regular
from ckpt_tools.formats.pickle.imports import (
    UNREAD,
    ImportScan,
    find_imports,
    starts_like_pickle,
)
from ckpt_tools.formats.pickle.npy import npy_pickle_offset
from ckpt_tools.formats.pickle.unpickler import MAX_PICKLE_BYTES
from ckpt_tools.formats.zip.directory import (
    FileSlice,
    ZipEntry,
    ZipSource,
    located,
    pread,
    read_zip_directory,
)
from ckpt_tools.formats.zip.records import read_head
from ckpt_tools.ops.scan.local_headers import local_entries
from ckpt_tools.ops.scan.sequence import sequence_pickles
from ckpt_tools.ops.scan.severity import Context, could_import
from ckpt_tools.ops.scan.tar_layout import member_pickles

__all__ = ["Walked", "is_npz", "storage_records", "walk_pickles"]

# A record is first tested on this many bytes; one that still parses as a pickle there is
# walked on up to _MOST bytes (a tensor's bytes stop parsing within a few opcodes).
_HEAD = 64 << 10
_MOST = 64 << 20
_LEGACY_PICKLES = ("magic number", "protocol version", "sys_info", "main pickle", "storage keys")
# What Python's zipfile raises listing an archive it cannot read.
_ZIPFILE_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError)


class Walked(NamedTuple):
    """One pickle found in a file: where, in which context, and what its walk found."""

    record: str
    context: Context
    scan: ImportScan


def walk_pickles(
    path: str,
    fmt: str,
    *,
    skip: frozenset[str] = frozenset(),
    entries: Sequence[ZipEntry] | None = None,
    source: RangeSource | None = None,
) -> Iterator[Walked]:
    """Every pickle in the file (or DCP folder) ``path`` of format ``fmt``, walked.

    ``skip`` names zip records not to walk (read already, by the restricted unpickler, or
    a storage's raw bytes: :func:`storage_records`);
    ``entries`` are a zip's records where our reader listed them already; ``source`` is the
    file read by ranges where ``path`` is its URL (not for tar or DCP, read member by member).

    Raises:
        CheckpointError: the layout itself cannot be read (a broken zip directory, a
            remote record's local header).
        OSError: the file cannot be read.
    """
    if fmt in ("torch-zip", "torchscript") and source is not None:
        yield from _zip_pickles(path, source, source.size, "", skip, entries)
    elif fmt in ("torch-zip", "torchscript"):
        fd = os.open(path, os.O_RDONLY)
        try:
            yield from _zip_pickles(path, fd, os.fstat(fd).st_size, "", skip, entries)
        finally:
            os.close(fd)
    elif fmt == "torch-legacy":
        yield from _sequence(path, len(_LEGACY_PICKLES), _LEGACY_PICKLES, source)
    elif fmt == "pickle":
        yield from _sequence(path, None, (), source)
    elif fmt == "torch-tar":
        yield from _tar_pickles(path)
    elif fmt == "dcp":
        yield from _dcp_pickles(path)
    elif fmt == "numpy" and is_npz(path, source):
        yield from _lenient_zip_pickles(path, source)
    elif fmt == "numpy":
        with open_buffered(path, source) as f:
            start = npy_pickle_offset(f.read(_HEAD))
            if start is not None:
                yield Walked("object array", "pickle", find_imports(f, start))


def _zip_pickles(
    path: str,
    fd: ZipSource,
    size: int,
    prefix: str,
    skip: frozenset[str] = frozenset(),
    entries: Sequence[ZipEntry] | None = None,
) -> Iterator[Walked]:
    remote = not isinstance(fd, (int, FileSlice))
    try:
        if entries is None:
            entries = read_zip_directory(path, fd, size, defer_local=remote)
    except CheckpointError:
        if isinstance(fd, FileSlice):
            raise
        # Our reader refuses the archive (the scan says why); torch's reader or another
        # tool may still read it, so its records are looked at the lenient way too.
        yield from _lenient_zip_pickles(path, fd if remote else None)
        raise
    script = any(e.name.endswith("/constants.pkl") for e in entries)
    context: Context = "torchscript" if script else "pickle"
    if remote:
        yield from _remote_zip_pickles(path, fd, entries, skip, context)  # type: ignore[arg-type]
        return
    for entry in entries:
        if entry.name.endswith("/") or entry.name in skip:
            continue
        data = _record_pickle(path, fd, entry)
        if data is not None:
            yield Walked(prefix + entry.name, context, _walk_record(entry, data))


def _remote_zip_pickles(
    path: str,
    source: RangeSource,
    entries: Sequence[ZipEntry],
    skip: frozenset[str],
    context: Context,
) -> Iterator[Walked]:
    """A remote zip's pickles, each record's local header checked first (as our reader checks
    them all when it opens a local zip). Walked in one pass, so each header's request also
    brings the record's first bytes; yielded only once every header passed, since a bad one
    makes it the archive our reader refuses, which is walked the lenient way instead."""
    found: list[Walked] = []
    try:
        for listed in entries:
            entry = located(path, source, listed)
            if entry.name.endswith("/") or entry.name in skip:
                continue
            data = _record_pickle(path, source, entry)
            if data is not None:
                found.append(Walked(entry.name, context, _walk_record(entry, data)))
    except CorruptCheckpointError:
        yield from _lenient_zip_pickles(path, source)
        raise
    yield from found


def storage_records(ckpt: Checkpoint) -> frozenset[str]:
    """The records of a torch zip ``ckpt`` that its pickle's persistent ids name as storages
    (``archive/data/0``): torch reads each as a tensor's raw bytes and never unpickles it,
    whatever its first bytes spell. Empty for other formats; a caller whose reader could
    not read the pickle knows none, and walks every record. A record named as a pickle
    (``.pkl``, which torch.save never names a storage) is left to the walk all the same."""
    return frozenset(
        f"{ckpt.archive_root}/data/{s.key}"
        for s in ckpt.storages.values()
        if ckpt.archive_root and f"data/{s.key}" in ckpt.records and not s.key.endswith(".pkl")
    )


def is_npz(path: str, source: RangeSource | None = None) -> bool:
    """A zip of ``.npy`` records only (``numpy.savez``), which numpy, not torch, reads.

    ``source`` is the file read by ranges where ``path`` is its URL.
    """
    infos = _zip_listing(path, source) or []
    return bool(infos) and all(i.filename.endswith(".npy") for i in infos)


def _zip_listing(path: str, source: RangeSource | None) -> list[zipfile.ZipInfo] | None:
    """The records Python's zipfile lists (``source`` read by ranges where ``path`` is its
    URL), or None where zipfile cannot read the archive."""
    try:
        with zipfile.ZipFile(path if source is None else source) as archive:  # type: ignore[arg-type]
            return archive.infolist()
    except RemoteError:
        raise  # a failed request is the caller's to report, not a zip zipfile cannot read
    except _ZIPFILE_ERRORS:
        return None


def _lenient_zip_pickles(path: str, source: RangeSource | None = None) -> Iterator[Walked]:
    """The pickles of a zip our reader refuses, found the lenient way (Python's zipfile
    lists the records; where it cannot either, a local file's records are found by their
    local headers, :mod:`~ckpt_tools.ops.scan.local_headers`) and read as torch reads them
    (no CRC-32 check)."""
    infos = _zip_listing(path, source)
    if infos is None and source is not None:
        return  # (a remote one is not searched byte by byte)
    fd: ZipSource = source if source is not None else os.open(path, os.O_RDONLY)
    try:
        if infos is None:
            entries: Iterable[ZipEntry] = local_entries(fd, os.fstat(fd).st_size)
            names = [e.name for e in entries]
        else:  # (each header read as its record is reached, as the walk reads them)
            entries = (e for e in (_entry_of(fd, i) for i in infos) if e is not None)
            names = [i.filename for i in infos]
        script = any(name.endswith("/constants.pkl") for name in names)
        context: Context = "torchscript" if script else "pickle"
        for entry in entries:
            data = _record_pickle(path, fd, entry)
            if data is not None:
                yield Walked(entry.name, context, _walk_record(entry, data))
        for info in infos or ():
            if info.compress_type not in (0, 8) and info.filename.endswith(".npy"):
                # bzip2 or LZMA: numpy.load reads such an .npz member, and unpickles it.
                yield Walked(info.filename, context, ImportScan((UNREAD,), None))
    finally:
        if source is None:
            os.close(fd)  # type: ignore[arg-type]


def _entry_of(fd: ZipSource, info: zipfile.ZipInfo) -> ZipEntry | None:
    """``info`` as a :class:`ZipEntry`, its data offset from its local header; None where
    it has none, or is compressed other than by deflate."""
    if info.header_offset < 0:  # zipfile's shift for bytes before a corrupt archive
        return None
    local = pread(fd, 30, info.header_offset)
    if len(local) < 30 or local[:4] != b"PK\x03\x04" or info.compress_type not in (0, 8):
        return None
    name_len, extra_len = (
        int.from_bytes(local[26:28], "little"),
        int.from_bytes(local[28:30], "little"),
    )
    return ZipEntry(
        info.filename,
        info.header_offset + 30 + name_len + extra_len,
        info.compress_size,
        info.file_size,
        info.CRC,
        info.compress_type == 8,
        info.header_offset,
    )


def _record_pickle(path: str, fd: ZipSource, entry: ZipEntry) -> bytes | None:
    """The bytes of ``entry`` where they start like a pickle and parse as one; else None."""
    # Named a pickle (in any case: torch reads data.PKL as data.pkl): read whole, walked even
    # if malformed.
    if entry.name.lower().endswith(".pkl"):
        head = read_head(fd, entry, _read_limit(entry))
        return head if starts_like_pickle(head, any_protocol=True) else None
    first = read_head(fd, entry, 2)  # most records are told apart here
    if first != b"\x93N" and not starts_like_pickle(first):
        return None
    head = read_head(fd, entry, _HEAD)
    at = npy_pickle_offset(head)  # an .npz archive's object arrays: numpy unpickles them
    if at is not None:
        return read_head(fd, entry, _read_limit(entry))[at:]
    if not starts_like_pickle(head):
        return None
    scan = find_imports(head)
    if scan.truncated and entry.file_size > len(head):
        head = read_head(fd, entry, _read_limit(entry))
        scan = find_imports(head)
    if scan.end is None and not (scan.truncated and scan.imports):
        return None  # not a pickle: a tensor's bytes, text, anything else
    return head


def _read_limit(entry: ZipEntry) -> int:
    """The most bytes of a record :func:`_record_pickle` reads: a ``.pkl`` whole (up to the
    reader's own limit), any other up to :data:`_MOST`."""
    return MAX_PICKLE_BYTES if entry.name.lower().endswith(".pkl") else _MOST


def _walk_record(entry: ZipEntry, data: bytes) -> ImportScan:
    """A zip record's pickle walked. ``data.pkl`` is the one torch reads as a pickle; where
    ``data`` holds it whole, its end is where torch's reader meets the end too."""
    whole = entry.name.endswith("/data.pkl") and len(data) >= entry.file_size
    scan = find_imports(data, cut_globals=whole)
    read = _read_limit(entry)
    if scan.truncated and entry.file_size > read:  # a loader reads on past what was walked
        return scan._replace(imports=(*scan.imports, UNREAD._replace(position=read)))
    return scan


def _sequence(
    path: str, most: int | None, names: tuple[str, ...], source: RangeSource | None = None
) -> Iterator[Walked]:
    """:func:`~ckpt_tools.ops.scan.sequence.sequence_pickles`, each pickle as a :class:`Walked`."""
    for record, scan in sequence_pickles(path, most, names, source):
        yield Walked(record, "pickle", scan)


def _tar_pickles(path: str) -> Iterator[Walked]:
    try:
        for where, scan in member_pickles(path):
            yield Walked(where, "pickle", scan)
    except (tarfile.TarError, EOFError) as e:
        # torch.load does not give up there: it reads the file as the legacy format.
        yield from _sequence(path, len(_LEGACY_PICKLES), _LEGACY_PICKLES)
        raise CorruptCheckpointError(f"{path!r}: the tar archive cannot be read ({e})") from e
    except ValueError as e:  # a PAX header tarfile cannot parse: torch.load stops there too
        raise CorruptCheckpointError(f"{path!r}: the tar archive cannot be read ({e})") from e
    # torch.load of a stream with no file number (a BytesIO, a bucket's file object) and
    # pickle.load read the same bytes as pickles from the first: a header can be one.
    # Only what a loader could import counts: a header's junk names fail to (config.json
    # reads as a GLOBAL of "onfig.json\0...").
    for walked in _sequence(path, len(_LEGACY_PICKLES), _LEGACY_PICKLES):
        scan = walked.scan
        kept = tuple(i for i in scan.imports if could_import(i))
        if kept:
            scan = scan._replace(
                imports=kept,
                called=tuple(i for i in scan.called if i in kept),
                mutated=tuple(i for i in scan.mutated if i in kept),
            )
            yield Walked(f"{walked.record} (the tar's bytes read as a pickle)", "pickle", scan)


def _dcp_pickles(folder: str) -> Iterator[Walked]:
    from ckpt_tools.formats.dcp.layout import METADATA_FILE
    from ckpt_tools.formats.dcp.metadata import DcpTensor, load_metadata_pickle, parse_metadata

    metadata = os.path.join(folder, METADATA_FILE)
    check_regular(metadata)  # a FIFO named .metadata would block an open()
    with open(metadata, "rb") as f:
        walk = find_imports(f)
    try:
        root = load_metadata_pickle(metadata)
    except CheckpointError:
        root = None  # the reader reports it; the pickle's own walk is judged as it stands
    # Read, its getattr calls (if any) were each the one form the reader admits.
    yield Walked(METADATA_FILE, "dcp-metadata" if root is None else "dcp-metadata-read", walk)
    try:
        items = parse_metadata(root, folder, metadata).items.values() if root is not None else ()
    except CheckpointError:
        return
    spans = {
        (c.file, c.offset, c.length)
        for item in items
        for c in (item.chunks if isinstance(item, DcpTensor) else (item,))
    }
    for file, offset, length in sorted(spans):
        check_regular(os.path.join(folder, file))
        fd = os.open(os.path.join(folder, file), os.O_RDONLY)
        piece, prefix = FileSlice(fd, offset, length), f"{file}@{offset}:"
        try:
            yield from _zip_pickles(folder, piece, length, prefix)
        except CheckpointError:
            # DCP hands an item to torch.load, which reads one that is no zip as a legacy
            # file: pickles from its start, the first run whatever it names.
            for walked in _sequence(folder, len(_LEGACY_PICKLES), _LEGACY_PICKLES, _Slice(piece)):
                yield walked._replace(record=prefix + walked.record)
            raise
        finally:
            os.close(fd)


class _Slice(RangeFile):
    """A :class:`FileSlice` read by ranges, as a file of its own."""

    def __init__(self, piece: FileSlice) -> None:
        super().__init__()
        self.piece, self.size = piece, piece.length

    def pread(self, count: int, offset: int) -> bytes:
        return pread(self.piece, count, offset)  # (reads stop at the slice's end)
