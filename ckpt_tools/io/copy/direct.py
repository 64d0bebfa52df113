"""Copying a large range straight to the disk (``O_DIRECT``) when it must reach the disk anyway.

A durable output is fsynced before it is named, so its bytes go to the disk before the
command ends whatever the copy does. Copied through the page cache, gigabytes of dirty pages
pile up faster than the kernel writes them back: past its dirty limits the copy is paced to
the writeback, and the final fsync waits for the rest, so every byte is copied twice (into
the cache, then to the device). Written with ``O_DIRECT`` from a read-only mapping of the
source, the same bytes go from the source's page cache to the device in one step, at the
device's pace, dirtying nothing (benchmarks/README.md has the measurements).

Only the part of a range that lies on whole pages in both files goes this way, and only where
source and output offsets agree modulo the page size (the layout-preserving rewrites of
:mod:`ckpt_tools.io.copy.layout` arrange that): ``O_DIRECT`` needs aligned file offsets, lengths
and memory, and a page of the mapping is aligned memory. The head and tail around it, and
every range this module declines, are copied through the page cache by the caller.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable

from ckpt_tools.formats.readahead import advise_willneed

__all__ = ["DIRECT_MIN", "aligned_span", "copy_direct", "direct_span"]

#: Ranges with fewer whole pages than this are left to the page cache: each direct write
#: waits for the device, and many small ones would wait in turn where one fsync waits once.
DIRECT_MIN = 8 << 20
# One write's most: pins this much of the source's page cache while the device reads it.
_WINDOW = 64 << 20
# A page: aligned for O_DIRECT's offsets, lengths and memory on any logical block size up to
# it, and the unit mmap offsets come in.
_ALIGN = max(mmap.ALLOCATIONGRANULARITY, mmap.PAGESIZE, 4096)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# What a file system says when it does not take O_DIRECT (F_SETFL), or not these offsets or
# this memory (pwrite): the caller copies through the page cache. Nothing else is taken as
# a refusal: a device gone (ENODEV), an unsupported operation below the file system
# (EOPNOTSUPP), an I/O error or a full disk is the disk failing, and fails the copy.
_REFUSED = frozenset({errno.EINVAL})
# The mapped source could not be read (it shrank after it was mapped, or a read failed):
# the page-cache copy reads the same bytes again, and reports a short source or the error.
_SOURCE_FAILED = frozenset({errno.EFAULT})


def aligned_span(src_offset: int, dst_offset: int, count: int, unit: int) -> tuple[int, int]:
    """``(head, body)``: bytes before the first ``unit`` boundary, then whole units after it.

    ``(0, 0)`` where source and output offsets disagree modulo ``unit`` (no boundary of one
    is a boundary of the other) or the range holds no whole unit. Reflinks share whole
    blocks, direct writes take whole pages: both cut a range this way.

    Example:
        >>> aligned_span(4096 + 100, 100, 3 * 4096, 4096)
        (3996, 8192)
        >>> aligned_span(0, 100, 3 * 4096, 4096)
        (0, 0)
    """
    if (src_offset - dst_offset) % unit:
        return 0, 0
    head = -dst_offset % unit
    body = (count - head) // unit * unit if count > head else 0
    return (head, body) if body > 0 else (0, 0)


def direct_span(src_offset: int, dst_offset: int, count: int) -> tuple[int, int]:
    """``(head, body)``: bytes before the first aligned offset, and aligned bytes to write direct.

    ``(0, 0)`` when nothing may go direct: ``O_DIRECT`` does not exist here, the offsets
    disagree modulo the page size, or the aligned part is under :data:`DIRECT_MIN`.

    Example:
        >>> direct_span(4096 + 100, 100, 64 << 20) == (3996, (64 << 20) - 4096)
        True
        >>> direct_span(0, 100, 64 << 20)
        (0, 0)
    """
    if not _O_DIRECT:
        return 0, 0
    head, body = aligned_span(src_offset, dst_offset, count, _ALIGN)
    return (head, body) if body >= DIRECT_MIN else (0, 0)


def copy_direct(
    src_fd: int,
    src_offset: int,
    dst_fd: int,
    dst_offset: int,
    count: int,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``count`` bytes of the source to the output with ``O_DIRECT``, window by window.

    Offsets and ``count`` must come from :func:`direct_span` (aligned, and agreeing modulo
    the page size). The output's file descriptor has ``O_DIRECT`` set for the copy and its
    flags restored after, whatever happens. A refusal is not remembered: asking again
    costs one ``fcntl`` call.

    Args:
        src_fd: the source, open for reading (it is mapped read-only).
        src_offset: where the bytes start in the source.
        dst_fd: the output, open for writing.
        dst_offset: where they go in the output.
        count: how many bytes.
        progress: called with each window's byte count as it is written.

    Returns:
        How many bytes were written, from the start of the range: ``count``, or fewer where
        this file system, this device or the source declined part way (nothing where it
        declined at once); the caller copies the rest another way.

    Raises:
        OSError: a write failed for a reason a different method would not fix (an I/O error,
            a full disk).
    """
    try:
        flags = fcntl.fcntl(dst_fd, fcntl.F_GETFL)
    except OSError:
        return 0
    done = 0
    try:
        try:
            fcntl.fcntl(dst_fd, fcntl.F_SETFL, flags | _O_DIRECT)
        except OSError as e:
            if e.errno not in _REFUSED:
                raise
            return 0
        while done < count:
            n = _write_window(src_fd, src_offset + done, dst_fd, dst_offset + done, count - done)
            if n <= 0:
                break
            done += n
            if progress is not None:
                progress(n)
            if n % _ALIGN:
                break  # a short write leaves the next offset unaligned: the rest goes buffered
    finally:
        # Inside the same try as the F_SETFL that set it, so that no exception in between
        # can leave the output in O_DIRECT (putting back flags never changed is harmless).
        fcntl.fcntl(dst_fd, fcntl.F_SETFL, flags)
    return done


def _write_window(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, left: int) -> int:
    """One window's direct write: bytes written, 0 where the output declined, -1 the source."""
    size = min(left, _WINDOW)
    try:
        window = mmap.mmap(src_fd, size, offset=src_offset, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return -1  # not mappable, or the source is shorter than the range
    with window:
        if left > size:
            # Ask for the next window while the device takes this one (cold sources).
            advise_willneed(src_fd, [(src_offset + size, min(left - size, _WINDOW))])
        with memoryview(window) as view:
            try:
                return os.pwrite(dst_fd, view, dst_offset)
            except OSError as e:
                if e.errno in _SOURCE_FAILED:
                    return -1
                if e.errno in _REFUSED:
                    return 0
                raise
