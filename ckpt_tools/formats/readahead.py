"""Asking the kernel to start reading file ranges now (``posix_fadvise(WILLNEED)``), advisory.

Readers ask for what they will read next so that the disk works while they do something
else: the zip directory reader for a window of local headers, the direct writer for the next
window of its source. Where the call is missing (not POSIX) or refused (a pipe, an offset
past ``off_t``), nothing happens and nothing is raised: the read itself still works.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["advise_willneed"]


def advise_willneed(fd: int, spans: Iterable[tuple[int, int]]) -> None:
    """Ask the kernel to start reading every ``(offset, length)`` span of ``fd``.

    Args:
        fd: an open file descriptor.
        spans: byte ranges, absolute offsets in the file.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     advise_willneed(f.fileno(), [(0, 4096), (2**63 + 5, 30)])  # never raises
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        for offset, length in spans:
            advise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    except (OSError, OverflowError, ValueError):  # refused, or an offset past off_t
        return
