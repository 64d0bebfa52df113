"""A tensor's elements as bytes in row-major order, read from its storage, torch-free.

A contiguous tensor's bytes are one run of its storage. Any other view (transposed,
strided, expanded) is gathered with numpy: the storage bytes the view spans
(:attr:`~ckpt_tools.descriptors.TensorRef.byte_span`) are read once with ``pread``, an
``as_strided`` array over them walks the view, and its elements are copied out in pieces of
at most ``chunk_bytes``, so no second copy of the whole tensor is ever held. Bytes are
copied, never interpreted: no dtype conversion, no byte order question.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import itemsize

if TYPE_CHECKING:
    import numpy as np

__all__ = ["DEFAULT_CHUNK_BYTES", "iter_row_major", "pread_exact"]

#: Largest piece :func:`iter_row_major` yields by default.
DEFAULT_CHUNK_BYTES = 8 << 20
# One pread call reads at most this much (Linux caps a single read near 2 GiB).
_MAX_READ = 1 << 30


def pread_exact(fd: int, nbytes: int, offset: int) -> bytearray:
    """Read exactly ``nbytes`` at ``offset`` of ``fd`` into a fresh buffer.

    Args:
        fd: an open file descriptor.
        nbytes: how many bytes to read.
        offset: where to start, from the start of the file.

    Returns:
        The bytes, in a buffer of their own.

    Raises:
        OSError: the read failed, or the file ends first (``EIO``, as
            :func:`ckpt_tools.io.zipwriter.copy_range` reports a short source).

    Example:
        >>> pread_exact(fd, 4, 128)  # doctest: +SKIP
        bytearray(b'\\x00\\x00\\x80?')
    """
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        if got <= 0:
            raise OSError(errno.EIO, f"source ended after {done} of {nbytes} bytes")
        done += got
    return buffer


def iter_row_major(
    fd: int, storage_offset: int, tensor: TensorRef, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes | bytearray]:
    """Yield ``tensor``'s elements in row-major order, as ``tensor.contiguous()`` holds them.

    Args:
        fd: the file the tensor's storage lies in, open for reading.
        storage_offset: where the storage's bytes start in that file (``ByteSpan.offset``).
        tensor: the view to read.
        chunk_bytes: the most bytes one piece holds (a piece never splits an element).

    Returns:
        An iterator of pieces whose concatenation is the tensor's ``nbytes`` bytes; nothing
        for a tensor without elements.

    Raises:
        OSError: the read failed or the file ends before the storage does.

    Example:
        >>> b"".join(iter_row_major(fd, span.offset, ref)) == ref_bytes  # doctest: +SKIP
        True
    """
    if tensor.numel == 0:
        return
    first, end = tensor.byte_span
    size = itemsize(tensor.dtype)
    if tensor.is_contiguous():
        step = max(size, chunk_bytes - chunk_bytes % size)
        for start in range(first, end, step):
            yield pread_exact(fd, min(step, end - start), storage_offset + start)
        return
    import numpy as np  # only non-contiguous views need it

    # Elements as opaque ``size``-byte values (numpy's void type): any dtype, bf16 and float8
    # included, is copied as it is, never converted.
    element = np.dtype(f"V{size}")
    raw = np.frombuffer(pread_exact(fd, end - first, storage_offset + first), dtype=element)
    view = np.lib.stride_tricks.as_strided(
        raw,
        shape=tensor.shape,
        strides=tuple(s * size for s in tensor.stride),
        writeable=False,
    )
    yield from _pieces(view, max(chunk_bytes, size))


def _pieces(view: np.ndarray, limit: int) -> Iterator[bytes]:
    """Row-major copies of ``view`` of at most ``limit`` bytes each (one element at least)."""
    if view.nbytes <= limit:
        yield view.tobytes()
        return
    row = view.nbytes // len(view)  # not 0-d: one element is at most ``limit``
    if row > limit:
        # One row is already too big: split each row along the next axis.
        for sub in view:
            yield from _pieces(sub, limit)
        return
    step = limit // row
    for start in range(0, len(view), step):
        yield view[start : start + step].tobytes()
