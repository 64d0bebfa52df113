"""A tensor's bytes from its chunks (DCP), in row-major order, in bounded memory.

A record is a list of pieces. A :class:`SpanPiece` is a byte range of a source file copied
as it is (``copy_file_range``): a chunk that is a contiguous slice of the full tensor along
dim 0 (FSDP's layout). An :class:`AssembledPiece` yields the rows of a tensor whose chunks
split other dimensions, gathered with numpy one bounded slab of dim-0 rows at a time.
torch is never imported.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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

# The most bytes an assembled slab holds (one dim-0 row more where a row is larger).
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
        """The tensor's bytes in row-major order, one slab of dim-0 rows at a time."""
        row = math.prod(self.shape[1:]) * self.itemsize
        if not self.nbytes:
            return
        step = max(1, slab_bytes // max(row, 1))
        kind = np.dtype(f"V{self.itemsize}")
        fds: dict[str, int] = {}
        try:
            for first in range(0, self.shape[0], step):
                last = min(first + step, self.shape[0])
                slab = np.empty((last - first, *self.shape[1:]), dtype=kind)
                for chunk in self.chunks:
                    self._fill(slab, first, last, chunk, kind, fds)
                yield memoryview(slab.reshape(-1).view(np.uint8))
        finally:
            for fd in fds.values():
                os.close(fd)

    def _fill(
        self,
        slab: np.ndarray,
        first: int,
        last: int,
        chunk: ChunkSource,
        kind: np.dtype,
        fds: dict[str, int],
    ) -> None:
        t = chunk.tensor
        lo, hi = max(first, chunk.offsets[0]), min(last, chunk.offsets[0] + t.shape[0])
        if lo >= hi or not t.numel:
            return
        # The chunk's rows lo..hi: the element range they span in its storage (strides >= 0).
        start = t.offset + (lo - chunk.offsets[0]) * t.stride[0]
        end = start + (hi - lo - 1) * t.stride[0]
        end += sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride[1:])) + 1
        if chunk.span.path not in fds:
            fds[chunk.span.path] = os.open(chunk.span.path, os.O_RDONLY)
        count = (end - start) * self.itemsize
        raw = os.pread(fds[chunk.span.path], count, chunk.span.offset + start * self.itemsize)
        if len(raw) != count:
            raise OSError(5, f"{chunk.span.path!r} ended inside a chunk")
        flat = np.frombuffer(raw, dtype=kind)
        part = np.lib.stride_tricks.as_strided(
            flat,
            shape=(hi - lo, *t.shape[1:]),
            strides=tuple(s * self.itemsize for s in t.stride),
            writeable=False,
        )
        inner = (slice(o, o + n) for o, n in zip(chunk.offsets[1:], t.shape[1:]))
        where = (slice(lo - first, hi - first), *inner)
        slab[where] = part


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
