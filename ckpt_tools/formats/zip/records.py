"""The bytes of one zip record, read or inflated as torch's reader (miniz) reads them.

:mod:`ckpt_tools.formats.zip.directory` checks where each record lies; this module reads what lies
there: a small record whole (checked against its size and CRC-32), a tensor's compressed
record inflated in bounded pieces and dropped (checked against its size only, as torch checks it).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats.zip.directory import ZipEntry, ZipSource, corrupt_zip, located, pread
from ckpt_tools.structure.text import human_bytes

__all__ = [
    "check_inflates",
    "crc_holds",
    "deflate_bound",
    "inflate",
    "read_entry",
    "read_head",
]


def check_inflates(path: str, fd: ZipSource, entry: ZipEntry, chunk: int = 1 << 20) -> None:
    """Inflate a compressed ``entry`` in bounded pieces as torch would, keeping nothing.

    torch inflates a compressed record when it reads it and refuses the file when the
    stream is damaged or inflates to another size than declared; torch does not check a
    record's CRC-32 when it reads it (its miniz is built without reader CRC checks), so
    neither does this.

    Raises:
        CorruptCheckpointError: the record does not inflate to exactly its declared size.
    """
    inflate(path, fd, entry, lambda _: None, chunk)


def inflate(
    path: str,
    fd: ZipSource,
    entry: ZipEntry,
    sink: Callable[[bytes], object],
    chunk: int = 1 << 20,
    *,
    check_crc: bool = False,
) -> None:
    """Inflate a compressed ``entry`` in bounded pieces as torch would, each piece handed to
    ``sink`` (:func:`check_inflates` keeps nothing); with ``check_crc``, its bytes checked
    against the entry's CRC-32 too, as the loaders check the values they hand out.

    Raises:
        CorruptCheckpointError: the record does not inflate to exactly its declared size (or
            to its CRC-32).
    """
    entry = located(path, fd, entry)
    inflater = zlib.decompressobj(-15)
    produced, at, end = 0, entry.data_offset, entry.data_offset + entry.compress_size
    crc = 0
    try:
        while at < end and not inflater.eof:
            raw = pread(fd, min(chunk, end - at), at)
            if not raw:
                break
            at += len(raw)
            while produced <= entry.file_size:
                out = inflater.decompress(raw, chunk)
                produced += len(out)
                if produced <= entry.file_size:
                    sink(out)
                    crc = zlib.crc32(out, crc) if check_crc else crc
                raw = inflater.unconsumed_tail
                if not raw and len(out) < chunk:
                    break
    except zlib.error as e:
        raise corrupt_zip(path, f"record {entry.name!r} does not inflate ({e})") from e
    if not inflater.eof or produced != entry.file_size:
        raise corrupt_zip(
            path,
            f"record {entry.name!r} does not inflate to its declared {entry.file_size} bytes "
            "(torch refuses it: unexpected decompressed size)",
        )
    if check_crc and crc != entry.crc32:
        raise corrupt_zip(
            path,
            f"record {entry.name!r} inflates to bytes whose CRC-32 is {crc:08x}, not the "
            f"{entry.crc32:08x} its zip entry says (torch loads them unchecked; the values "
            "cannot be vouched for)",
        )


def read_entry(path: str, fd: ZipSource, entry: ZipEntry, limit: int) -> bytes:
    """The bytes of ``entry``, inflated if need be, checked against its size and CRC-32.

    Args:
        path: the file, for messages.
        fd: an open file descriptor of it.
        entry: a record from :func:`read_zip_directory`.
        limit: refuse a record that declares more bytes than this.

    Returns:
        The record's bytes.

    Raises:
        CorruptCheckpointError: the bytes do not match the declared size or CRC-32, or a
            compressed record declares more bytes than deflate needs for its size.
        ResourceLimitError: the record declares more than ``limit`` bytes.
    """
    if entry.file_size > limit:
        raise ResourceLimitError(
            f"{path!r}: record {entry.name!r} declares {entry.file_size} bytes, over the "
            f"{human_bytes(limit)} limit",
            path=path,
        )
    if entry.compressed and entry.compress_size > deflate_bound(entry.file_size):
        # Bytes no deflate stream of that size needs: refused unread (a remote read would
        # fetch them all, a local one hold them in memory).
        raise CorruptCheckpointError(
            f"{path!r}: record {entry.name!r} fails its size or CRC-32 check: it declares "
            f"{entry.compress_size} compressed bytes for {entry.file_size} bytes, more than "
            f"deflate ever needs ({deflate_bound(entry.file_size)}); the file is damaged",
            path=path,
        )
    entry = located(path, fd, entry)
    raw = pread(fd, entry.compress_size, entry.data_offset)
    data = raw
    if entry.compressed:
        try:
            # At most one byte past the declared size: a lying size is found, not obeyed.
            data = zlib.decompressobj(-15).decompress(raw, entry.file_size + 1)
        except zlib.error as e:
            raise corrupt_zip(path, f"record {entry.name!r} does not inflate ({e})") from e
    if len(data) != entry.file_size or not crc_holds(data, entry.crc32):
        raise CorruptCheckpointError(
            f"{path!r}: record {entry.name!r} fails its size or CRC-32 check (the file is "
            "damaged); download or copy it again",
            path=path,
        )
    return data


def crc_holds(data: bytes, recorded: int) -> bool:
    """Whether ``data`` matches the CRC-32 its zip record holds.

    torch writes 0 for every record when told not to compute them
    (``torch.utils.serialization.config.save.compute_crc32 = False``), and its reader
    checks none: a 0 says nothing about the bytes.

    Example:
        >>> crc_holds(b"abc", zlib.crc32(b"abc")), crc_holds(b"abc", 0), crc_holds(b"abc", 1)
        (True, True, False)
    """
    return recorded == 0 or zlib.crc32(data) == recorded


def deflate_bound(size: int) -> int:
    """The most bytes a deflate stream of ``size`` bytes takes (zlib's ``compressBound``).

    Example:
        >>> import zlib
        >>> data = bytes(range(256)) * 4096
        >>> len(zlib.compress(data, 0)) <= deflate_bound(len(data))
        True
    """
    return size + (size >> 12) + (size >> 14) + (size >> 25) + 13


def read_head(fd: ZipSource, entry: ZipEntry, count: int) -> bytes:
    """The first ``count`` bytes of ``entry``'s contents, inflated where it is deflated.

    Nothing is checked (a scan looks at what a lenient reader would see): a damaged stream
    gives the bytes inflated before the damage.
    """
    if not entry.compressed:
        return pread(fd, min(count, entry.file_size), entry.data_offset)
    inflater = zlib.decompressobj(-15)
    out, at, end = bytearray(), entry.data_offset, entry.data_offset + entry.compress_size
    try:
        while at < end and len(out) < count and not inflater.eof:
            raw = pread(fd, min(1 << 20, end - at), at)
            if not raw:
                break
            at += len(raw)
            # (What max_length leaves unconsumed is not needed: the loop ends at count.)
            out += inflater.decompress(raw, count - len(out))
    except zlib.error:
        pass
    return bytes(out)
