"""Tensors whose rows lie back to back, each row in its own order: a ``channels_last`` kernel.

Such a tensor fills its storage, row after row, with the dimensions past the first permuted
inside each row. A computed storage for it (a merge) is written in that order, and read back
in row-major order one block of rows at a time, so no whole copy is ever held.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import itemsize

__all__ = [
    "from_row_major",
    "permuted_layout",
    "row_layout",
    "row_major_stream",
    "to_row_major",
]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Rows gathered before they are reordered: a block of about this many bytes, one row at least.
_BLOCK_BYTES = 1 << 22


def row_layout(t: TensorRef) -> tuple[int, ...] | None:
    """The dimensions past the first, outermost first, in the order each row of ``t`` lies in
    memory: ``(1, 2, 3)`` for a row-major kernel, ``(2, 3, 1)`` for a ``channels_last`` one.
    None where the rows are not dense and back to back (a transposed or strided view).

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> storage = StorageRef("0", "float32", 5 * 3 * 2 * 2, "cpu")
        >>> row_layout(TensorRef(storage, 0, (5, 3, 2, 2), (12, 1, 6, 3), "float32"))
        (2, 3, 1)
    """
    if t.numel == 0:  # no bytes to order: torch's strides after a 0 are its own choice
        return tuple(range(1, len(t.shape)))
    rest = sorted(range(1, len(t.shape)), key=lambda d: -t.stride[d])  # ties keep their order
    expected = 1
    for d in reversed(rest):
        if t.shape[d] != 1 and t.stride[d] != expected:
            return None
        expected *= t.shape[d]
    if t.shape and t.shape[0] != 1 and t.stride[0] != expected:
        return None
    return tuple(rest)


def permuted_layout(t: TensorRef) -> tuple[int, ...] | None:
    """``t``'s :func:`row_layout` where it is not row-major; None where it is, or has none."""
    layout = row_layout(t)
    return None if layout is None or list(layout) == sorted(layout) else layout


def to_row_major(rows: np.ndarray, t: TensorRef) -> np.ndarray:
    """Rows of ``t`` as they lie in memory, shaped ``(count, row length)``, each put in
    row-major order.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> t = TensorRef(StorageRef("0", "uint8", 6, "cpu"), 0, (1, 3, 2), (6, 1, 3), "uint8")
        >>> to_row_major(np.arange(6).reshape(1, 6), t).tolist()
        [[0, 3, 1, 4, 2, 5]]
    """
    layout = permuted_layout(t)
    if layout is None:
        return rows
    laid = rows.reshape(-1, *(t.shape[d] for d in layout))
    back = (0, *(1 + layout.index(d) for d in range(1, len(t.shape))))
    return laid.transpose(back).reshape(rows.shape)


def from_row_major(rows: np.ndarray, t: TensorRef) -> np.ndarray:
    """Rows of ``t`` in row-major order, shaped ``(count, row length)``, each put in the order
    ``t`` lays it out in memory: the inverse of :func:`to_row_major`."""
    layout = permuted_layout(t)
    if layout is None:
        return rows
    return rows.reshape(-1, *t.shape[1:]).transpose(0, *layout).reshape(rows.shape)


def row_major_stream(chunks: Iterable[bytes], t: TensorRef) -> Iterator[bytes]:
    """The bytes of ``t``'s storage, as ``chunks`` yields them in storage order, in
    ``t``'s row-major order (a safetensors entry's), a block of whole rows at a time.

    ``t`` fills its storage row after row (:func:`row_layout` is not None).
    """
    size = itemsize(t.dtype)
    row = size * (t.numel // t.shape[0]) if t.shape and t.shape[0] else 0
    if permuted_layout(t) is None or row == 0:
        yield from chunks
        return
    block = max(1, _BLOCK_BYTES // row) * row
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        whole = len(pending) - len(pending) % row
        if whole and (len(pending) >= block or whole == len(pending)):
            yield _reordered(bytes(pending[:whole]), t, size, row)
            del pending[:whole]
    if pending:
        raise ValueError(f"a storage of {t.nbytes} bytes ended inside a row of {row}")


def _reordered(data: bytes, t: TensorRef, size: int, row: int) -> bytes:
    bits = np.frombuffer(data, dtype=_UINT[size]).reshape(len(data) // row, row // size)
    return to_row_major(bits, t).tobytes()
