"""A byte range read in bounded pieces, from a local file or a file read by ranges.

Every loop that streams a record's bytes (into an output, a checksum, a tensor) reads
through :func:`pread_chunks`, with ``os.pread`` on a descriptor or a remote file's
``pread``: one place decides the piece size and what a source that ends early means.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator

__all__ = ["CHUNK", "Pread", "SourceEndedError", "fd_pread", "pread_chunks"]

#: The piece a local range is read in: large enough that a call's cost is nothing beside
#: its bytes, small enough to hold a few at once.
CHUNK = 8 << 20

#: Reads ``count`` bytes at ``offset`` (``os.pread``'s order without the descriptor); fewer
#: bytes only at the end of the source.
Pread = Callable[[int, int], bytes]


class SourceEndedError(OSError):
    """A source ended before the range it was asked for (``EIO``, as a short file reads).

    Example:
        >>> str(SourceEndedError(2, 4))
        '[Errno 5] source ended after 2 of 4 bytes'
    """

    def __init__(self, done: int, count: int) -> None:
        super().__init__(errno.EIO, f"source ended after {done} of {count} bytes")
        self.done = done
        self.count = count


def fd_pread(fd: int) -> Pread:
    """``os.pread`` on ``fd``, as a :data:`Pread`."""
    return lambda count, offset: os.pread(fd, count, offset)


def pread_chunks(pread: Pread, offset: int, count: int, *, chunk: int = CHUNK) -> Iterator[bytes]:
    """The ``count`` bytes at ``offset``, in pieces of at most ``chunk`` bytes, one read each.

    Args:
        pread: reads from the source (:func:`fd_pread`, or a remote file's ``pread``).
        offset: where the range starts.
        count: its length.
        chunk: the most bytes one read asks for.

    Returns:
        An iterator over the pieces, in order; they add up to ``count`` bytes.

    Raises:
        SourceEndedError: the source ended first (raised when the iterator reaches it).

    Example:
        >>> data = b"abcdefgh"
        >>> read = lambda n, at: data[at : at + n]
        >>> list(pread_chunks(read, 1, 6, chunk=4))
        [b'bcde', b'fg']
        >>> list(pread_chunks(read, 6, 4))
        Traceback (most recent call last):
        ...
        ckpt_tools.io.ranges.SourceEndedError: [Errno 5] source ended after 2 of 4 bytes
    """
    done = 0
    while done < count:
        piece = pread(min(chunk, count - done), offset + done)
        if not piece:
            raise SourceEndedError(done, count)
        yield piece
        done += len(piece)
