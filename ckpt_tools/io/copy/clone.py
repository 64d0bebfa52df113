"""Copying byte ranges between files: reflinks, direct writes, ``copy_file_range``, read/write.

Every copy of a source's bytes into an output goes through :func:`copy_range`, and every
choice it makes comes from its arguments: the method to try first, and the output's
:class:`Writeback`, which says whether the output will be fsynced. It tries, in this order,
and falls back on the errors that mean "not here" (EOPNOTSUPP, EXDEV, EINVAL, ENOSYS,
ENOTTY, EPERM ...), never on a failing disk:

1. ``clone``: the ``FICLONERANGE`` ioctl shares the source's blocks with the output (XFS
   with ``reflink=1``, btrfs): no byte is copied or written back, whatever the size. Only
   whole blocks can be shared, and only when source and output offsets agree modulo the
   block size (the layout-preserving rewrites of :mod:`ckpt_tools.io.copy.layout` arrange
   that); the unaligned head and tail are copied by the next methods.
2. ``direct``: for an output that will be fsynced, the whole pages of a large range are
   written with ``O_DIRECT`` from a mapping of the source (:mod:`ckpt_tools.io.copy.direct`):
   those bytes must reach the disk before the command ends anyway, and this way they do not
   pile up as dirty pages first. An output that will not be fsynced (``--no-fsync``) is
   copied through the page cache, as ``cp`` copies.
3. ``copy_file_range``: the kernel copies page-cache pages (and may reflink by itself).
4. ``readwrite``: ``pread``/``pwrite`` in 8 MiB pieces.

The ``method`` argument names the first method tried (``clone`` by default). Later methods
remain fallbacks, so naming a method never makes a copy fail; tests name each one and
compare the outputs byte for byte.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import struct
import sys
from collections.abc import Callable
from typing import NamedTuple, Protocol

from ckpt_tools._types import one_of
from ckpt_tools.io.copy.direct import aligned_span, copy_direct, direct_span
from ckpt_tools.io.ranges import SourceEndedError

__all__ = [
    "COPY_METHODS",
    "CopyCounts",
    "Writeback",
    "copy_method",
    "copy_range",
    "pwrite_all",
]

COPY_METHODS = ("clone", "direct", "copy_file_range", "readwrite")
# _IOW(0x94, 13, struct file_clone_range): {s64 src_fd; u64 src_offset, src_length, dest_offset}
_FICLONERANGE = 0x4020940D
_CLONE_RANGE = struct.Struct("=qQQQ")
# Errors meaning "this method is not available for these files": try the next one.
_NOT_HERE = frozenset(
    {
        errno.EXDEV,
        errno.EINVAL,
        errno.ENOSYS,
        errno.EOPNOTSUPP,
        errno.ENOTTY,
        errno.EPERM,
        errno.EBADF,
        errno.ETXTBSY,
    }
)
_CHUNK = 8 << 20
_WRITEBACK_EVERY = 64 << 20
# One copy_file_range call moves at most MAX_RW_COUNT (2 GiB - 4 KiB) on Linux; ask for the
# most below it that keeps the next call on a 64 KiB boundary, so a large copy takes as few
# calls as ``cp`` makes.
_KERNEL_STEP = (2 << 30) - (64 << 10)
_KERNEL_ALIGN = 64 << 10


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``.

    ``os.pwrite`` may write only part (a full disk takes what fits and reports the count); the
    rest is retried, so a full disk raises ``OSError(ENOSPC)`` instead of leaving a hole that
    a later ``ftruncate`` would silently fill with zeros.

    Raises:
        OSError: the write failed.
    """
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"no byte written at offset {offset}")
        view, offset = view[n:], offset + n


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        func = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    return func


class Writeback:
    """An output's writeback: whether it will be fsynced, and its early start where it will.

    A durable output is fsynced once at the end; without an early start, all of its
    writeback waits for that fsync and runs after the copying instead of beside it. Every
    ``_WRITEBACK_EVERY`` bytes written, Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``
    starts the writeback of that range without waiting for it. Best effort: nothing happens
    where the call is missing or fails; durability still comes from the final fsync. Nothing
    happens either for an output that will not be fsynced: with no fsync to shorten, it would
    only compete with the copy for the disk.

    Args:
        fd: the output.
        durable: whether the output will be fsynced (``AtomicFile.durable``). The copy
            engine reads it here: :func:`copy_range` writes a durable output's large ranges
            straight to the disk.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     Writeback(f.fileno(), durable=False).durable
        False
    """

    def __init__(self, fd: int, *, durable: bool) -> None:
        self._fd = fd
        self.durable = durable
        self._start: int | None = None
        self._end = 0

    def wrote(self, offset: int, count: int) -> None:
        """Record that ``count`` bytes were written at ``offset``."""
        self._start = offset if self._start is None else min(self._start, offset)
        self._end = max(self._end, offset + count)
        if self.durable and self._end - self._start >= _WRITEBACK_EVERY:
            func = _sync_file_range()
            if func is not None:
                func(self._fd, self._start, self._end - self._start, 2)  # SYNC_FILE_RANGE_WRITE
            self._start = None


class _Told(Protocol):
    durable: bool

    def wrote(self, offset: int, count: int) -> None: ...


class CopyCounts(NamedTuple):
    """How many bytes of a copy each method moved."""

    cloned: int = 0
    kernel: int = 0
    readwrite: int = 0
    direct: int = 0

    def __add__(self, other: CopyCounts) -> CopyCounts:
        return CopyCounts(
            self.cloned + other.cloned,
            self.kernel + other.kernel,
            self.readwrite + other.readwrite,
            self.direct + other.direct,
        )


def copy_method(method: str) -> str:
    """``method``, checked: the name of a copy method to try first.

    Raises:
        UsageError: a name not in :data:`COPY_METHODS`.

    Example:
        >>> copy_method("readwrite")
        'readwrite'
    """
    return one_of(method, COPY_METHODS, "method")


def copy_range(
    src_fd: int,
    src_offset: int,
    dst_fd: int,
    dst_offset: int,
    count: int,
    progress: Callable[[int], None] | None = None,
    writeback: _Told | None = None,
    *,
    method: str = "clone",
) -> CopyCounts:
    """Copy ``count`` bytes between files at explicit offsets, sharing blocks where possible.

    Args:
        src_fd: the source, open for reading.
        src_offset: where the bytes start in the source.
        dst_fd: the output, open for writing.
        dst_offset: where they go in the output.
        count: how many bytes.
        progress: called with each piece's byte count as it is done.
        writeback: the output's :class:`Writeback`: told of every range written (not of
            shared blocks, which dirty nothing), and whether the output will be fsynced.
            ``None``: an output that will not be, copied through the page cache.
        method: the first method to try, one of :data:`COPY_METHODS`.

    Returns:
        The :class:`CopyCounts` of bytes each method moved.

    Raises:
        OSError: a read or write failed (disk full, I/O error), or the source ended early.
        UsageError: ``method`` is not a copy method.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as a, tempfile.TemporaryFile() as b:
        ...     _ = a.write(b"0123456789")
        ...     a.flush()
        ...     counts = copy_range(a.fileno(), 2, b.fileno(), 0, 5, method="readwrite")
        ...     os.pread(b.fileno(), 10, 0), counts.readwrite
        (b'23456', 5)
    """
    first = copy_method(method)
    durable = writeback is not None and writeback.durable
    head, body, middle, method_used = 0, 0, _clone_body, "cloned"
    if count > 0 and first == "clone":
        head, body = _clone_span(src_fd, src_offset, dst_fd, dst_offset, count)
    # Direct writes only where the bytes must reach the disk before the command ends anyway.
    if not body and (first == "direct" or (first == "clone" and durable)):
        head, body = direct_span(src_offset, dst_offset, count)
        middle, method_used = copy_direct, "direct"
    if not body:
        kernel = first != "readwrite"
        return _copy_bytes(
            src_fd, src_offset, dst_fd, dst_offset, count, progress, writeback, kernel=kernel
        )
    # The head goes first, so the output grows in order; then the middle moves what it can
    # (and reports it to ``progress``), and whatever it left is copied after it.
    counts = _copy_bytes(src_fd, src_offset, dst_fd, dst_offset, head, progress, writeback)
    moved = middle(src_fd, src_offset + head, dst_fd, dst_offset + head, body, progress)
    counts += CopyCounts(**{method_used: moved})
    done = head + moved
    return counts + _copy_bytes(
        src_fd, src_offset + done, dst_fd, dst_offset + done, count - done, progress, writeback
    )


def _clone_body(
    src_fd: int,
    src_offset: int,
    dst_fd: int,
    dst_offset: int,
    body: int,
    progress: Callable[[int], None] | None,
) -> int:
    """Share ``body`` bytes of whole blocks; 0 where the clone is refused after the trial."""
    try:
        _clone(src_fd, src_offset, dst_fd, dst_offset, body)
    except OSError as e:
        if e.errno not in _NOT_HERE:
            raise
        return 0  # past the source's end, or refused after the trial: copy it all
    if progress is not None:
        progress(body)
    return body


def _clone_span(
    src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, count: int
) -> tuple[int, int]:
    """``(head, body)``: bytes before the first shareable block, and whole blocks to share.

    ``(0, 0)`` when nothing can be shared: the offsets disagree modulo the block size, the
    range holds no whole block, or a trial clone of the first block is refused. The trial is
    made for every range, not remembered: it costs one system call, and a refusal depends
    on the pair of open files (their file systems, and their mounts: EXDEV), not on a key
    a cache could hold.
    """
    try:
        block = max(os.fstatvfs(dst_fd).f_frsize, 1)
    except OSError:
        return 0, 0
    head, body = aligned_span(src_offset, dst_offset, count, block)
    if not body:
        return 0, 0
    try:
        # Trial: the first block alone (the head is not written yet; a clone past the end of
        # the output is allowed and the head fills the gap before it).
        _clone(src_fd, src_offset + head, dst_fd, dst_offset + head, block)
    except OSError as e:
        if e.errno not in _NOT_HERE:
            raise
        return 0, 0
    return head, body


def _clone(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> None:
    fcntl.ioctl(dst_fd, _FICLONERANGE, _CLONE_RANGE.pack(src_fd, src_offset, length, dst_offset))


def _copy_bytes(
    src_fd: int,
    src_offset: int,
    dst_fd: int,
    dst_offset: int,
    count: int,
    progress: Callable[[int], None] | None,
    writeback: _Told | None,
    kernel: bool = True,
) -> CopyCounts:
    """Copy with ``copy_file_range`` (unless ``kernel`` is False), else pread/pwrite."""
    done = 0
    by_kernel = 0
    use_kernel = kernel and hasattr(os, "copy_file_range")
    largest = _WRITEBACK_EVERY if writeback is not None and writeback.durable else _KERNEL_STEP
    while done < count:
        step = min(count - done, largest)
        head = (-(dst_offset + done)) % _KERNEL_ALIGN
        if use_kernel and head and count - done > _KERNEL_ALIGN:
            # Up to the output's next 64 KiB boundary first: the long call after it starts
            # aligned, and the kernel fills the output's page cache in large pieces
            # (benchmarks/README.md, the "no 64 KiB split" ablation).
            step = min(step, head)
        if use_kernel:
            try:
                n = os.copy_file_range(src_fd, dst_fd, step, src_offset + done, dst_offset + done)
            except OSError as e:
                if e.errno in _NOT_HERE:
                    use_kernel = False
                    continue
                raise
            by_kernel += n
        else:
            data = os.pread(src_fd, min(step, _CHUNK), src_offset + done)
            if data:
                pwrite_all(dst_fd, data, dst_offset + done)
            n = len(data)
        if n == 0:
            raise SourceEndedError(done, count)
        if writeback is not None:
            writeback.wrote(dst_offset + done, n)
        done += n
        if progress is not None:
            progress(n)
    return CopyCounts(kernel=by_kernel, readwrite=done - by_kernel)
