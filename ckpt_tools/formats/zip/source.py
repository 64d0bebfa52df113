"""What the zip reader reads from: a file descriptor, a slice of one, or a remote file.

One ``pread`` serves them all, so every function of the zip reader takes any of the three.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.base import RangeSource

__all__ = ["FileSlice", "ZipSource", "corrupt_zip", "pread"]


class FileSlice(NamedTuple):
    """``length`` bytes of an open file from ``base``, read as if they were a file of their own.

    A DCP ``.distcp`` file holds one ``torch.save`` archive per chunk, back to back; each
    archive's offsets are relative to its own start (torch reads it through a file view).
    Every function here takes a FileSlice wherever it takes a file descriptor.
    """

    fd: int
    base: int
    length: int


# Whatever the zip reader reads from: a descriptor, a slice of one, or a remote file.
ZipSource = int | FileSlice | RangeSource


def pread(fd: ZipSource, count: int, offset: int) -> bytes:
    """Up to ``count`` bytes at ``offset`` of a file descriptor, a :class:`FileSlice` or a
    remote file read by ranges.

    Fewer where the file (or slice) ends first, as ``os.pread`` returns them.
    """
    if isinstance(fd, int):
        return os.pread(fd, count, offset)
    if isinstance(fd, FileSlice):
        # Reads stop at the slice's end, as they stop at a file's end.
        count = max(0, min(count, fd.length - offset))
        return os.pread(fd.fd, count, fd.base + offset) if count else b""
    return fd.pread(count, offset)


def corrupt_zip(path: str, why: str) -> CorruptCheckpointError:
    """The error for an archive torch's reader refuses or might read otherwise: ``why``."""
    return CorruptCheckpointError(
        f"{path!r} is not a zip archive torch reads the same way: {why}", path=path
    )
