"""A remote file read by byte ranges, through a small cache: the one way remote bytes are read.

Every reader reads a file with ``pread(count, offset)`` (or as a file object for a pickle
stream). Here each read that misses the cache becomes one ranged request: the first takes
the object's first :data:`HEAD_FETCH` bytes, a read in its last :data:`HEAD_FETCH` bytes
takes all of them (a zip's end records, its central directory and last records lie
there), any other at least :data:`MIN_FETCH`, never a byte the cache holds. So the few
small reads that parse a checkpoint's structure cost a request or two in all, not one per
field. What was fetched is kept up to :data:`CACHE_BYTES`, except reads over
:data:`KEEP_LIMIT` (a tensor's bytes).

The checks every transport (HTTP, S3) makes of a ranged answer are here too: its
``Content-Range`` (:func:`check_content_range`), a whole object sent instead
(:func:`range_refused`), and the same object at every request (:class:`SameObject`).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass
from typing import Protocol

from ckpt_tools.errors import RangeNotSupportedError, Remedy, RemoteError
from ckpt_tools.formats.base import RangeFile
from ckpt_tools.io.ranges import CHUNK

__all__ = [
    "DOWNLOAD_FIRST",
    "HEAD_FETCH",
    "MIN_FETCH",
    "RangeTransport",
    "RemoteFile",
    "SameObject",
    "TransferStats",
    "check_content_range",
    "range_refused",
]

# The first request, and the one for the object's end: a .pt's data.pkl and a safetensors
# header of a few hundred tensors fit in the first, a zip's end records with its central
# directory in the last.
HEAD_FETCH = 256 << 10
# Any other request: one record's local header and first bytes (a scan reads those).
MIN_FETCH = 64 << 10
# What the cache keeps at most, and the largest read it keeps.
CACHE_BYTES = 8 << 20
KEEP_LIMIT = 1 << 20
# Bytes per request when a record's bytes are streamed out: the shared range reader's.
STREAM_CHUNK = CHUNK
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: What to do with a file a server will not serve by ranges.
DOWNLOAD_FIRST = Remedy(text="download the file and pass the local path")


class RangeTransport(Protocol):
    """A remote object read by byte ranges: an HTTP URL, an S3 object.

    ``get(start, end)`` returns the bytes ``[start, min(end, size))`` and the object's total
    size, in one request; it raises a :class:`~ckpt_tools.errors.CheckpointError` for a
    missing object, refused credentials, a network failure, or a server that answers a
    range with the whole object.
    """

    url: str

    def get(self, start: int, end: int) -> tuple[bytes, int]: ...

    def close(self) -> None: ...


@dataclass
class TransferStats:
    """What reading remote files cost: requests made and bytes received (bodies only)."""

    requests: int = 0
    bytes_received: int = 0

    def add(self, received: int) -> None:
        """Count one request that received ``received`` body bytes."""
        self.requests += 1
        self.bytes_received += received

    def __str__(self) -> str:
        """``2 requests, 512 KiB received (524,288 bytes)``."""
        from ckpt_tools.structure.text import human_bytes

        plural = "" if self.requests == 1 else "s"
        return (
            f"{self.requests} request{plural}, {human_bytes(self.bytes_received)} received "
            f"({self.bytes_received:,} bytes)"
        )


def range_refused(url: str, size: int | None) -> RangeNotSupportedError:
    """The refusal of a server that answered a byte range with the whole object."""
    whole = "the whole file" if size is None else f"the whole {size}-byte file"
    return RangeNotSupportedError(
        f"{url}: the server ignored Range and would send {whole} (refused before reading "
        "it); ckpt_tools reads remote files only from servers that answer byte ranges",
        path=url,
        remedies=(DOWNLOAD_FIRST,),
    )


def check_content_range(url: str, header: str | None, start: int, end: int) -> tuple[int, int]:
    """A ``Content-Range`` answer to a request for ``[start, end)``: ``(length, total)``.

    Args:
        url: the URL, for the error.
        header: the ``Content-Range`` header (``bytes a-b/N``).
        start, end: the range asked for.

    Returns:
        The body's length, which must be ``min(end, N) - start``, and the object's size N.

    Raises:
        RemoteError: a header missing or malformed, an unknown size, or a range other than
            the one asked for.

    Example:
        >>> check_content_range("u", "bytes 10-19/15000", 10, 20)
        (10, 15000)
    """
    found = _CONTENT_RANGE.fullmatch((header or "").strip())
    if found is None or found[3] == "*":
        raise RemoteError(f"{url}: a ranged answer without a usable Content-Range: {header!r}")
    first, last, total = int(found[1]), int(found[2]), int(found[3])
    if first != start or last + 1 != min(end, total) or last < first:
        raise RemoteError(
            f"{url}: asked for bytes {start}-{end - 1}, the server answered {header!r}"
        )
    return last + 1 - first, total


class SameObject:
    """What names the object a transport reads, from its first answer, checked against every
    later answer: a file replaced between two requests must not be read as one file.

    The size is always compared; the ETag where both answers carry one, else the
    Last-Modified date. A weak or strong ETag is compared as a string, so nothing relies on
    how a server treats ``If-Match`` or ``If-Range``.

    Args:
        url: the URL, for the error.

    Example:
        >>> same = SameObject("u")
        >>> same.check(10, '"a"', None)
        >>> try:
        ...     same.check(10, '"b"', None)
        ... except RemoteError as e:
        ...     print(e)
        u: the remote file changed while it was read (ETag '"a"' then '"b"'); read it again
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._first: tuple[int, str | None, str | None] | None = None

    def check(self, size: int, etag: str | None, modified: str | None) -> None:
        """Remember the first answer's ``size``, ``etag`` and ``modified``; refuse a later
        answer that differs.

        Raises:
            RemoteError: the object changed (the message says how).
        """
        if self._first is None:
            self._first = (size, etag, modified)
            return
        was_size, was_etag, was_modified = self._first
        if size != was_size:
            self._refuse(f"{was_size} bytes then {size}")
        if was_etag and etag:
            if etag != was_etag:
                self._refuse(f"ETag {was_etag!r} then {etag!r}")
        elif was_modified and modified and modified != was_modified:
            self._refuse(f"Last-Modified {was_modified!r} then {modified!r}")

    def _refuse(self, how: str) -> None:
        raise RemoteError(
            f"{self.url}: the remote file changed while it was read ({how}); read it again",
            path=self.url,
        )


class RemoteFile(RangeFile):
    """A remote object as a read-only, seekable file with ``pread`` and a range cache.

    Args:
        transport: how the object's ranges are fetched.
        stats: where requests and bytes are counted (shared by the files of one read).

    Attributes:
        url: the object's URL, as the user gave it.
        size: its size in bytes (learned from the first request).

    Example:
        >>> class Bytes:
        ...     url = "mem://x"
        ...     def __init__(self, data): self.data = data
        ...     def get(self, start, end): return self.data[start:end], len(self.data)
        ...     def close(self): pass
        >>> f = RemoteFile(Bytes(b"0123456789"))
        >>> f.size, f.pread(3, 2), f.stats.requests
        (10, b'234', 1)
    """

    def __init__(self, transport: RangeTransport, stats: TransferStats | None = None) -> None:
        super().__init__()
        self.transport = transport
        self.url = transport.url
        self.stats = stats if stats is not None else TransferStats()
        self._extents: list[tuple[int, bytes]] = []  # (offset, bytes), most recent last
        data, self.size = transport.get(0, HEAD_FETCH)
        self.stats.add(len(data))
        self._keep(0, data)

    # -- ranged reads ------------------------------------------------------------------

    def pread(self, count: int, offset: int) -> bytes:
        """Up to ``count`` bytes at ``offset``; fewer where the object ends, as ``os.pread``.

        Raises:
            OSError: ``EINVAL`` for a negative offset or count, as ``os.pread`` raises it.
        """
        if offset < 0 or count < 0:
            raise OSError(errno.EINVAL, f"negative offset or count: {offset}, {count}")
        end = min(offset + count, self.size)
        if end <= offset:
            return b""
        cached = self._cached(offset, end)
        if cached is not None:
            return cached
        head = self._cached_head(offset, end)
        if head:  # (a record's first bytes came with its local header): fetch only the rest
            return head + self.pread(end - offset - len(head), offset + len(head))
        start, stop = offset, max(end, offset + MIN_FETCH)
        if stop > self.size - HEAD_FETCH:  # near the end: take the whole tail block
            start, stop = min(offset, max(0, self.size - HEAD_FETCH)), self.size
        # Fetch no byte twice: stop where a cached run covering the rest begins (the tail
        # block a zip's directory came in, before the last record's local header).
        cut = min([stop, *(at for at, got in self._extents if offset < at < stop <= at + len(got))])
        data = self._fetch(start, cut)
        if len(data) <= KEEP_LIMIT:
            self._keep(start, data)
        head = data[offset - start : end - start]
        return head if end <= cut else head + self.pread(end - cut, cut)

    def _fetch(self, start: int, end: int) -> bytes:
        data, _ = self.transport.get(start, end)
        self.stats.add(len(data))
        return data

    def _cached(self, start: int, end: int) -> bytes | None:
        for at, data in reversed(self._extents):
            if at <= start and end <= at + len(data):
                return data[start - at : end - at]
        return None

    def _cached_head(self, start: int, end: int) -> bytes:
        """The longest cached run of bytes from ``start`` towards ``end``."""
        runs = [
            data[start - at : end - at]
            for at, data in self._extents
            if at <= start < at + len(data)
        ]
        return max(runs, key=len, default=b"")

    @property
    def cached_bytes(self) -> int:
        """How many fetched bytes the cache holds now (at most :data:`CACHE_BYTES`)."""
        return sum(len(data) for _, data in self._extents)

    def forget(self) -> None:
        """Drop the cache: the file's structure is read, and many such files (a sharded
        checkpoint's shards) would otherwise each keep their first bytes."""
        self._extents.clear()

    def _keep(self, offset: int, data: bytes) -> None:
        self._extents.append((offset, data))
        while self.cached_bytes > CACHE_BYTES and len(self._extents) > 1:
            self._extents.pop(0)

    # -- the file object (pickle streams read through it): RangeFile's, over pread ----

    def close(self) -> None:
        if not self.closed:
            self.transport.close()
        super().close()
