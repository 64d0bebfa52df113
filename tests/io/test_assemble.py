"""Assembling a tensor from its chunks (DCP) in bounded slabs, against numpy's own layout.

The oracle is numpy: the whole array's ``tobytes()`` (row-major), and its slices for the
chunks, stored in files in their own layouts (contiguous, or transposed as DCP keeps a
transposed view).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef
from ckpt_tools.io.assemble import AssembledPiece, ChunkSource


def _grid(shape: tuple[int, ...], splits: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """The boxes of ``shape`` cut into ``splits[i]`` parts along each dim (uneven allowed)."""
    cuts = [np.array_split(np.arange(n), k) for n, k in zip(shape, splits)]
    return [tuple(slice(p[0], p[-1] + 1) for p in parts) for parts in itertools.product(*cuts)]


def _piece(
    full: np.ndarray, boxes: list[tuple[slice, ...]], folder: Path, transposed: bool
) -> AssembledPiece:
    """Each box of ``full`` stored in a file of its own (after 8 bytes of something else)."""
    chunks = []
    for i, box in enumerate(boxes):
        part = full[box]
        stored = part.T.copy() if transposed else part.copy()  # a transposed chunk's bytes
        path = folder / f"chunk{i}"
        path.write_bytes(b"x" * 8 + stored.tobytes())
        item = full.itemsize
        strides = tuple(st // item for st in (stored.T.strides if transposed else stored.strides))
        storage = StorageRef(str(i), "float32", part.size, "cpu")
        tensor = TensorRef(storage, 0, part.shape, strides, "float32")
        chunks.append(ChunkSource(tuple(s.start for s in box), tensor, ByteSpan(str(path), 8, 0)))
    return AssembledPiece(full.shape, full.itemsize, tuple(chunks))


@pytest.mark.parametrize(
    ("shape", "splits"),
    [
        ((1, 40), (1, 3)),  # one row, sharded on dim 1: larger than a slab
        ((2, 3, 10), (1, 2, 3)),
        ((3, 17), (2, 4)),
        ((4, 1, 9), (2, 1, 2)),
        ((6, 4), (1, 2)),
        ((5,), (3,)),
    ],
)
@pytest.mark.parametrize("slab_bytes", [4, 12, 36, 1 << 20])
@pytest.mark.parametrize("transposed", [False, True])
def test_slabs_are_the_tensor_in_row_major_order_and_bounded(
    tmp_path: Path,
    shape: tuple[int, ...],
    splits: tuple[int, ...],
    slab_bytes: int,
    transposed: bool,
) -> None:
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    piece = _piece(full, _grid(shape, splits), tmp_path, transposed)
    slabs = [bytes(s) for s in piece.iter_bytes(slab_bytes)]
    assert b"".join(slabs) == full.tobytes()
    assert max(map(len, slabs)) <= max(slab_bytes, full.itemsize)


def test_a_transposed_chunk_is_read_once_not_once_per_slab(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every block of rows of a transposed chunk spans nearly all of its bytes.
    full = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    piece = _piece(full, _grid(full.shape, (1, 2)), tmp_path, transposed=True)
    read = []
    real_pread = os.pread

    def counted(fd: int, count: int, offset: int) -> bytes:
        read.append(count)
        return real_pread(fd, count, offset)

    monkeypatch.setattr(os, "pread", counted)
    slabs = [bytes(s) for s in piece.iter_bytes(48 * 4 * 4)]  # 4 rows a slab: 16 slabs
    assert b"".join(slabs) == full.tobytes() and len(slabs) == 16
    assert sum(read) <= 2 * full.nbytes, sum(read)
