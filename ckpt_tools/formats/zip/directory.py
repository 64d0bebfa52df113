"""A strict reader of a zip archive's directory, read the way torch's reader (miniz) reads it.

Python's :mod:`zipfile` is lenient where torch is not, and the two can then see different
archives in the same bytes: it shifts every offset when bytes precede the archive (torch
refuses), lets a repeated name silently replace an earlier one, and trusts the central
directory over the local headers. This reader takes the central directory as torch does and
refuses every such ambiguity instead of resolving it:

- the end record ends the file (no trailing bytes), and the central directory ends exactly
  where the end record (or its zip64 form) begins, so no offset needs shifting;
- every record's local header agrees with the central directory on name (and on sizes and
  CRC where it states them), and its bytes lie before the central directory;
- no name repeats; only stored and deflated records, none encrypted;
- the sanity checks miniz makes on every central entry when torch opens an archive: a
  stored record's two sizes agree, a non-empty record has compressed bytes.

Every declared count and size is checked against the file size and
:data:`~ckpt_tools.formats.pickle.limits.MAX_ZIP_DIRECTORY_BYTES` before anything is read.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from typing import NamedTuple

from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.base import RangeSource
from ckpt_tools.formats.pickle.limits import MAX_ZIP_DIRECTORY_BYTES
from ckpt_tools.formats.readahead import advise_willneed
from ckpt_tools.formats.zip.end_records import end_records
from ckpt_tools.formats.zip.source import FileSlice, ZipSource, corrupt_zip, pread

__all__ = [
    "FileSlice",
    "RangeSource",
    "ZipEntry",
    "ZipSource",
    "corrupt_zip",
    "located",
    "pread",
    "read_zip_directory",
]


_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_CENTRAL_SIG = b"PK\x01\x02"
# The MS-DOS folder bit of an entry's external attributes, which miniz reads as a folder.
_DOS_FOLDER = 0x10
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_LOCAL_SIG = b"PK\x03\x04"
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_STORED, _DEFLATED = 0, 8
_FLAG_DATA_DESCRIPTOR = 0x8
# The central-directory flags torch's reader (miniz) refuses: encryption (0x1), patched data
# (0x20) and strong encryption (0x40) when the record is read; a masked local header (0x2000,
# an encrypted central directory) when the archive is opened. We refuse them on any record.
_FLAGS_REFUSED = 0x1 | 0x20 | 0x40 | 0x2000


class ZipEntry(NamedTuple):
    """One record as the central directory declares it, checked against its local header."""

    name: str
    data_offset: int
    compress_size: int
    file_size: int
    crc32: int
    compressed: bool
    # Where the record's local header starts: a layout-preserving rewrite copies the header
    # and the bytes as one run (io/copy/layout.py). -1 where unknown.
    header_offset: int = -1
    # The name's bytes as stored: torch's reader compares those, not the decoded text.
    raw_name: bytes = b""
    # Where its local header was not read yet (``data_offset`` is then -1): the directory's
    # flags and where the record's bytes must end (the central directory's offset).
    flags: int = 0
    bound: int = -1


def read_zip_directory(
    path: str, fd: ZipSource, size: int, *, defer_local: bool = False
) -> list[ZipEntry]:
    """Read and check the central directory of the zip archive open as ``fd``.

    Args:
        path: the file, for messages.
        fd: an open file descriptor of it (or a slice of one, or a remote file).
        size: its size in bytes.
        defer_local: leave each record's local header unread (``data_offset`` -1) until
            :func:`located` is asked for it. Remotely each local header costs a request,
            so a metadata read trusts the central directory and the check happens when a
            record's bytes are read.

    Returns:
        The records in central-directory order.

    Raises:
        CorruptCheckpointError: the archive is malformed, truncated, or ambiguous.
        ResourceLimitError: the central directory is over the size limit.

    Example:
        >>> import io, os, tempfile, zipfile
        >>> tmp = os.path.join(tempfile.mkdtemp(), "a.zip")
        >>> with zipfile.ZipFile(tmp, "w") as z:
        ...     z.writestr("archive/version", "3")
        >>> fd = os.open(tmp, os.O_RDONLY)
        >>> [e.name for e in read_zip_directory(tmp, fd, os.path.getsize(tmp))]
        ['archive/version']
        >>> os.close(fd)
    """
    try:
        count, cd_offset, cd_size, cd_end = end_records(path, fd, size)
        if cd_size > MAX_ZIP_DIRECTORY_BYTES:
            raise ResourceLimitError(
                f"{path!r}: the zip directory declares {cd_size} bytes, over the "
                f"{MAX_ZIP_DIRECTORY_BYTES >> 20} MiB limit",
                path=path,
            )
        if cd_offset + cd_size != cd_end:
            raise corrupt_zip(
                path,
                "its central directory does not end where the end record begins (bytes were "
                "added before or inside the archive; torch refuses such a file)",
            )
        if count * _CENTRAL.size > cd_size:
            raise corrupt_zip(path, f"it declares {count} records in a {cd_size}-byte directory")
        directory = pread(fd, cd_size, cd_offset)
        return _entries(path, fd, directory, count, cd_offset, defer_local)
    except (struct.error, UnicodeDecodeError) as e:
        raise corrupt_zip(path, f"a header cannot be decoded ({e})") from e


def _prefetch(fd: ZipSource, spans: list[tuple[int, int]]) -> None:
    """Ask the kernel to start reading every ``(offset, length)`` span now (advisory).

    Local headers lie one per record across the file; read one by one from a cold cache (a
    freshly cloned output is always cold), each read waits on the disk in turn, while asked
    for together they are fetched in one sweep. Where ``posix_fadvise`` is missing or fails,
    nothing changes.
    """
    if isinstance(fd, FileSlice):
        advise_willneed(fd.fd, ((fd.base + offset, length) for offset, length in spans))
    elif isinstance(fd, int):
        advise_willneed(fd, spans)


def _entries(
    path: str, fd: ZipSource, directory: bytes, count: int, cd_offset: int, defer_local: bool
) -> list[ZipEntry]:
    unchecked = (
        ZipEntry(name, -1, csize, usize, crc, method == _DEFLATED, offset, raw, flags, cd_offset)
        for raw, name, flags, method, crc, csize, usize, offset in _central_entries(
            path, directory, count, cd_offset
        )
    )
    if defer_local:
        return list(unchecked)
    entries: list[ZipEntry] = []
    # A window at a time: the reads overlap, and the pages asked for stay few (a million
    # records would otherwise ask for gigabytes at once).
    while window := list(itertools.islice(unchecked, _PREFETCH_WINDOW)):
        _prefetch(fd, [(e.header_offset, _LOCAL.size + len(e.raw_name)) for e in window])
        entries.extend(located(path, fd, e) for e in window)
    return entries


_PREFETCH_WINDOW = 1024


def _central_entries(
    path: str, directory: bytes, count: int, cd_offset: int
) -> Iterator[tuple[bytes, str, int, int, int, int, int, int]]:
    """The central directory's entries, checked on their own (their local headers are not).

    A local header must end before the central directory begins (``cd_offset``); one
    declared past it is missing, and is refused before any read or advice is given an
    offset (a zip64 offset can exceed what ``off_t`` holds).

    Yields:
        ``(raw name, name, flags, method, crc32, compressed size, size, local header
        offset)`` of each, with zip64 values in place.
    """
    seen: set[bytes] = set()
    at = 0
    for index in range(count):
        fields = _CENTRAL.unpack_from(directory, at)
        if fields[0] != _CENTRAL_SIG:
            raise corrupt_zip(path, f"directory entry {index} has no signature")
        flags, method, crc, csize, usize = fields[5], fields[6], fields[9], fields[10], fields[11]
        name_len, extra_len, comment_len, offset = fields[12], fields[13], fields[14], fields[18]
        start = at + _CENTRAL.size
        raw_name = directory[start : start + name_len]
        extra = directory[start + name_len : start + name_len + extra_len]
        at = start + name_len + extra_len + comment_len
        if at > len(directory):
            raise corrupt_zip(path, "its central directory is truncated")
        try:
            # torch.load lists the records as Python text, UTF-8 whatever the flags say
            # (``get_all_records``), and fails on any other name.
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError as e:
            raise corrupt_zip(
                path,
                f"record {raw_name!r} is not named in UTF-8 ({e.reason} at byte {e.start}); "
                "torch.load fails listing the archive's records",
            ) from e
        if raw_name in seen:
            raise corrupt_zip(
                path, f"record {name!r} appears twice (readers disagree on which one)"
            )
        seen.add(raw_name)
        if flags & _FLAGS_REFUSED or method not in (_STORED, _DEFLATED):
            raise corrupt_zip(
                path,
                f"record {name!r} is encrypted, patched or compressed with method {method} "
                f"(flags 0x{flags:04x}), which torch's zip reader does not support",
            )
        usize, csize, offset = _zip64_sizes(path, name, extra, usize, csize, offset)
        if offset + _LOCAL.size + name_len > cd_offset:
            raise corrupt_zip(
                path,
                f"the local header of record {name!r} is missing (declared at offset "
                f"{offset}, past the start of the central directory at {cd_offset})",
            )
        _check_central_sizes(path, name, method, csize, usize, fields[15])
        if usize and (fields[17] & _DOS_FOLDER or raw_name.endswith(b"/")):
            raise corrupt_zip(
                path,
                f"record {name!r} is marked as a folder but holds {usize} bytes: torch's zip "
                "reader reads a folder's record as empty",
            )
        yield raw_name, name, flags, method, crc, csize, usize, offset
    if at != len(directory):
        raise corrupt_zip(path, "its central directory holds more than the records it declares")


def _check_central_sizes(
    path: str, name: str, method: int, csize: int, usize: int, disk: int
) -> None:
    """The sanity checks miniz makes on every central entry when torch opens the archive.

    torch refuses the whole archive ("invalid header or archive is corrupted") when an
    entry fails them, whether or not that record is ever read: a non-empty record without
    compressed bytes, a stored record whose two sizes differ. (miniz tests the latter only
    when the modification time is zero too, as torch.save writes it; otherwise torch reads
    the uncompressed size and ignores the other: such a record is refused here either way.)
    """
    if (method == _STORED and csize != usize) or (usize and not csize):
        raise corrupt_zip(
            path,
            f"record {name!r} declares {csize} bytes compressed and {usize} bytes "
            f"{'stored' if method == _STORED else 'inflated'} (torch refuses such an archive "
            "or ignores one of the sizes)",
        )
    if disk != 0:
        raise corrupt_zip(path, f"record {name!r} lies on disk {disk} (it spans several disks)")


def _zip64_sizes(
    path: str, name: str, extra: bytes, usize: int, csize: int, offset: int
) -> tuple[int, int, int]:
    """Replace the 0xFFFFFFFF fields by their zip64 extra values, in the order zip64 lists them."""
    wanted = [usize == _U32, csize == _U32, offset == _U32]
    if not any(wanted):
        return usize, csize, offset
    at = 0
    while at + 4 <= len(extra):
        tag, length = struct.unpack_from("<2H", extra, at)
        if tag == 1:
            if 8 * sum(wanted) > length:
                break
            values = iter(struct.unpack_from(f"<{sum(wanted)}Q", extra, at + 4))
            declared = (usize, csize, offset)
            usize, csize, offset = (next(values) if w else v for w, v in zip(wanted, declared))
            return usize, csize, offset
        at += 4 + length
    raise corrupt_zip(path, f"record {name!r} lacks the zip64 sizes its header announces")


def located(path: str, fd: ZipSource, entry: ZipEntry) -> ZipEntry:
    """``entry`` with its local header read and checked, where the directory deferred it.

    Raises:
        CorruptCheckpointError: the local header is missing or disagrees with the central
            directory, or the record's bytes run into the central directory.
    """
    if entry.data_offset >= 0:
        return entry
    central = (entry.flags, entry.crc32, entry.compress_size, entry.file_size)
    data_offset = _check_local(path, fd, entry.raw_name, entry.name, central, entry.header_offset)
    if data_offset + entry.compress_size > entry.bound:
        raise corrupt_zip(
            path,
            f"record {entry.name!r} needs {entry.compress_size} bytes at offset {data_offset}, "
            f"past the start of the central directory at {entry.bound} (truncated or "
            "overlapping)",
        )
    return entry._replace(data_offset=data_offset)


def _check_local(
    path: str,
    fd: ZipSource,
    raw_name: bytes,
    name: str,
    central: tuple[int, int, int, int],
    offset: int,
) -> int:
    """Check the local header at ``offset`` against the central entry; its data offset."""
    header = pread(fd, _LOCAL.size + len(raw_name), offset)
    if len(header) < _LOCAL.size or header[:4] != _LOCAL_SIG:
        raise corrupt_zip(path, f"the local header of record {name!r} is missing")
    fields = _LOCAL.unpack_from(header)
    name_len, extra_len = fields[-2:]
    if name_len != len(raw_name) or header[_LOCAL.size :] != raw_name:
        raise corrupt_zip(path, f"record {name!r} is named differently in its local header")
    flags, crc, csize, usize = central
    local = fields[7:10]  # crc, compressed size, size
    if not flags & _FLAG_DATA_DESCRIPTOR and any(
        _U32 not in (a, b) and a != b for a, b in zip(local, (crc, csize, usize))
    ):
        raise corrupt_zip(path, f"record {name!r} has other sizes in its local header")
    return offset + _LOCAL.size + name_len + extra_len
