"""A tensor's bytes from its chunks (DCP), in row-major order, in bounded memory.

A record is a list of pieces. A :class:`SpanPiece` is a byte range of a source file copied
as it is (``copy_file_range``): a chunk that is a contiguous slice of the full tensor along
dim 0 (FSDP's layout). An :class:`AssembledPiece` yields the bytes of a tensor whose chunks
split other dimensions, gathered with numpy one bounded slab at a time: dim-0 rows, or parts
of a row where one row is larger than a slab (a ``(1, N)`` tensor sharded on dim 1). A chunk
stored in another layout (a transposed view, as DCP keeps it), whose every slab spans nearly
all of its bytes, is read whole once and held while its tensor is assembled.
torch is never imported.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ckpt_tools.descriptors import ByteSpan, TensorRef
from ckpt_tools.io.ranges import fd_pread, pread_chunks
from ckpt_tools.io.writers.zipfile import Writeback, copy_range, pwrite_all

__all__ = [
    "SLAB_BYTES",
    "AssembledPiece",
    "ChunkSource",
    "SpanPiece",
    "crc32_combine",
    "write_pieces",
]

# The most bytes an assembled slab holds (one element more where an element is larger).
SLAB_BYTES = 16 << 20


@dataclass(frozen=True)
class SpanPiece:
    """Bytes copied as they lie: ``span`` of a source file, with their CRC-32 when known."""

    span: ByteSpan
    crc32: int | None = None

    @property
    def nbytes(self) -> int:
        return self.span.nbytes


@dataclass(frozen=True)
class ChunkSource:
    """One chunk of a tensor: where it sits in the tensor, and its stored tensor's bytes."""

    offsets: tuple[int, ...]
    tensor: TensorRef
    span: ByteSpan


@dataclass(frozen=True)
class AssembledPiece:
    """A whole tensor of ``shape`` (elements of ``itemsize`` bytes) assembled from chunks."""

    shape: tuple[int, ...]
    itemsize: int
    chunks: tuple[ChunkSource, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def iter_bytes(self, slab_bytes: int = SLAB_BYTES) -> Iterator[memoryview]:
        """The tensor's bytes in row-major order, one slab of at most ``slab_bytes`` at a time
        (:func:`_blocks`: dim-0 rows, or parts of one row where a row alone is larger)."""
        if not self.nbytes:
            return
        kind = np.dtype(f"V{self.itemsize}")
        files = _ChunkFiles()
        try:
            for block in _blocks(self.shape, self.itemsize, slab_bytes):
                prefix, first, last = block
                dim = len(prefix)
                slab = np.empty((last - first, *self.shape[dim + 1 :]), dtype=kind)
                for chunk in self.chunks:
                    self._fill(slab, block, chunk, kind, files)
                yield memoryview(slab.reshape(-1).view(np.uint8))
        finally:
            files.close()

    def _fill(
        self,
        slab: np.ndarray,
        block: tuple[tuple[int, ...], int, int],
        chunk: ChunkSource,
        kind: np.dtype,
        files: _ChunkFiles,
    ) -> None:
        """Copy the part of ``chunk`` that lies in ``block`` into ``slab``."""
        prefix, first, last = block
        dim, t = len(prefix), chunk.tensor
        # The block as a box of the tensor: one index on each dim before ``dim``, all after.
        box_lo = (*prefix, first, *(0 for _ in self.shape[dim + 1 :]))
        box_hi = (*(i + 1 for i in prefix), last, *self.shape[dim + 1 :])
        lo = [max(b, o) for b, o in zip(box_lo, chunk.offsets)]
        hi = [min(b, o + n) for b, o, n in zip(box_hi, chunk.offsets, t.shape)]
        if not t.numel or any(a >= b for a, b in zip(lo, hi)):
            return
        # The overlap, a view of the chunk's storage: the bytes it spans are one read.
        start = t.offset + sum((a - o) * st for a, o, st in zip(lo, chunk.offsets, t.stride))
        overlap = replace(t, offset=start, shape=tuple(b - a for a, b in zip(lo, hi)))
        first_byte, end_byte = overlap.byte_span
        if end_byte - first_byte > 4 * overlap.nbytes:
            # A chunk in another layout (transposed): every block spans nearly all of it.
            held_first, held = files.whole(chunk)
            raw = held[first_byte - held_first : end_byte - held_first]
        else:
            raw = files.read(chunk, first_byte, end_byte - first_byte)
        part = np.lib.stride_tricks.as_strided(
            np.frombuffer(raw, dtype=kind),
            shape=overlap.shape[dim:],
            strides=tuple(st * self.itemsize for st in t.stride[dim:]),
            writeable=False,
        )
        where = (slice(lo[dim] - first, hi[dim] - first), *map(slice, lo[dim + 1 :], hi[dim + 1 :]))
        slab[where] = part


class _ChunkFiles:
    """The chunks' files, each opened once, and the chunks read whole (held while the tensor
    is assembled), each read once."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._whole: dict[int, tuple[int, bytes]] = {}

    def read(self, chunk: ChunkSource, first_byte: int, count: int) -> bytes:
        """``count`` bytes of ``chunk``'s storage from ``first_byte``."""
        path = chunk.span.path
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        raw = os.pread(self._fds[path], count, chunk.span.offset + first_byte)
        if len(raw) != count:
            raise OSError(errno.EIO, f"{path!r} ended inside a chunk")
        return raw

    def whole(self, chunk: ChunkSource) -> tuple[int, bytes]:
        """Where ``chunk``'s bytes start in its storage, and all of them, read once."""
        if id(chunk) not in self._whole:
            first, end = chunk.tensor.byte_span
            self._whole[id(chunk)] = first, self.read(chunk, first, end - first)
        return self._whole[id(chunk)]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)


def _blocks(
    shape: tuple[int, ...], itemsize: int, slab_bytes: int
) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """A tensor in row-major order as blocks of at most ``slab_bytes`` (one element more only
    where an element is larger): ``(index on each dim before d, first, last on dim d)``, all of
    every dim after d, d the first dim whose trailing part fits (0 where a dim-0 row does).

    Example:
        >>> list(_blocks((2, 6), 4, 16))  # a row of 24 bytes is split
        [((0,), 0, 4), ((0,), 4, 6), ((1,), 0, 4), ((1,), 4, 6)]
        >>> list(_blocks((5, 2), 4, 16))
        [((), 0, 2), ((), 2, 4), ((), 4, 5)]
    """
    fits = (d for d in range(len(shape)) if math.prod(shape[d + 1 :]) * itemsize <= slab_bytes)
    dim = next(fits, len(shape) - 1)
    step = max(1, slab_bytes // (math.prod(shape[dim + 1 :]) * itemsize))
    for prefix in itertools.product(*map(range, shape[:dim])):
        for first in range(0, shape[dim], step):
            yield prefix, first, min(first + step, shape[dim])


Piece = SpanPiece | AssembledPiece


def write_pieces(
    fd: int,
    at: int,
    pieces: Sequence[Piece],
    writeback: Writeback | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``pieces`` back to back from ``at``, returning the CRC-32 of what was written.

    Span pieces are copied in the kernel, their CRC-32 combined from the one their source
    records (read through Python only where it is unknown); assembled ones are written slab
    by slab.

    Raises:
        OSError: a read or write failed, or a source ended early.
    """
    fds: dict[str, int] = {}
    crc = 0
    try:
        for piece in pieces:
            if isinstance(piece, SpanPiece):
                path = piece.span.path
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                copy_range(fds[path], piece.span.offset, fd, at, piece.nbytes, progress, writeback)
                piece_crc = piece.crc32
                if piece_crc is None:
                    piece_crc = _crc_of(fds[path], piece.span.offset, piece.nbytes)
                crc = crc32_combine(crc, piece_crc, piece.nbytes)
                at += piece.nbytes
                continue
            for slab in piece.iter_bytes():
                pwrite_all(fd, slab, at)
                crc = zlib.crc32(slab, crc)
                if writeback is not None:
                    writeback.wrote(at, len(slab))
                if progress is not None:
                    progress(len(slab))
                at += len(slab)
    finally:
        for src in fds.values():
            os.close(src)
    return crc


def _crc_of(fd: int, offset: int, count: int) -> int:
    crc = 0
    for data in pread_chunks(fd_pread(fd), offset, count):
        crc = zlib.crc32(data, crc)
    return crc


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's method).

    Lets a record made of copied spans get its CRC without reading its bytes.

    Example:
        >>> import zlib
        >>> a, b = zlib.crc32(b"hello "), zlib.crc32(b"world")
        >>> crc32_combine(a, b, 5) == zlib.crc32(b"hello world")
        True
    """
    if len2 <= 0:
        return crc1
    op = [0xEDB88320] + [1 << i for i in range(31)]  # the operator for one zero bit
    op = _gf2_square(_gf2_square(op))  # four zero bits
    while len2:
        op = _gf2_square(op)  # one zero byte, then 2, 4, 8, ... (bit i of len2)
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2
