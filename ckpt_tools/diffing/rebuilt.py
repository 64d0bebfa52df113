"""Sparse and nested tensors compared as torch sees them: their index parts exactly, their
values as a dense tensor's are (bit-equal, or close under ``atol``/``rtol``).

Each side is turned into :class:`Pieces`: a sparse COO tensor is coalesced first (indices
sorted, duplicates summed, as torch does before any elementwise use), so two files listing the
same elements in another order compare equal; a compressed one (CSR, CSC, BSR, BSC) is
canonical already; a nested tensor is its components (a jagged one's: its values between
consecutive offsets, checked to lie inside them). A file's tensor is rebuilt from its
parts with torch's invariant checks, so a malformed one is refused as ``torch.load`` refuses
it. Meta tensors have no parts: the engine compares their strides.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import torch

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.diffing.parts import TensorDiff
from ckpt_tools.diffing.value_stats import ValueStats, flat_cpu, with_stats, with_view_bits
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.pickle.jagged import check_jagged_parts, jagged_arguments
from ckpt_tools.formats.pickle.rebuilt import check_nested_parts
from ckpt_tools.loading.tensor_io import TensorReader

__all__ = ["Pieces", "compare_pieces", "file_pieces", "tensor_pieces"]

_COMPRESSED = {
    "sparse_csr": ("crow_indices", "col_indices"),
    "sparse_bsr": ("crow_indices", "col_indices"),
    "sparse_csc": ("ccol_indices", "row_indices"),
    "sparse_bsc": ("ccol_indices", "row_indices"),
}


@dataclass(frozen=True)
class Pieces:
    """What a sparse or nested tensor is compared by.

    Attributes:
        index: named integer tensors that say where the values lie (compared exactly).
        values: the values (one tensor for a sparse tensor, one per component of a nested
            one), compared as dense tensors are.
    """

    index: tuple[tuple[str, torch.Tensor], ...]
    values: tuple[torch.Tensor, ...]


def tensor_pieces(tensor: torch.Tensor) -> Pieces | None:
    """The pieces of an in-memory sparse or nested tensor; None for another layout.

    Example:
        >>> coo = torch.sparse_coo_tensor([[1, 0]], [2.0, 3.0], (2,))
        >>> tensor_pieces(coo).index[0][1].tolist(), tensor_pieces(coo).values[0].tolist()
        ([[0, 1]], [3.0, 2.0])
    """
    tensor = tensor.detach()
    if tensor.is_nested:
        components = tuple(c.cpu() for c in tensor.unbind())
        sizes = torch.tensor([list(c.shape) for c in components], dtype=torch.int64)
        return Pieces((("component sizes", sizes),), components)
    layout = str(tensor.layout).removeprefix("torch.")
    if layout == "sparse_coo":
        tensor = tensor.coalesce()
        return Pieces((("indices", tensor.indices()),), (tensor.values(),))
    names = _COMPRESSED.get(layout)
    if names is None:
        return None
    index = tuple((name, getattr(tensor, name)()) for name in names)
    return Pieces(index, (tensor.values(),))


def file_pieces(reader: TensorReader, ref: RebuiltTensor, where: str) -> Pieces | None:
    """The pieces of a file's sparse or nested tensor, rebuilt from its parts.

    Raises:
        CorruptCheckpointError: torch refuses the tensor its parts describe (an index out of
            range), or a nested or jagged component lies past the end of its buffer.
    """
    try:
        if ref.layout == "jagged":
            return _jagged_pieces(reader, jagged_arguments(ref))
        parts = [_read(reader, part) for part in ref.parts]
        if ref.layout == "nested":
            return _nested_pieces(*parts)
        if ref.layout == "sparse_coo":
            tensor = torch.sparse_coo_tensor(*parts, ref.shape, check_invariants=True)
        elif ref.layout in _COMPRESSED:
            layout = getattr(torch, ref.layout)
            with warnings.catch_warnings():  # torch's "in beta state" says nothing of the file
                warnings.filterwarnings("ignore", ".* support is in beta state", UserWarning)
                tensor = torch.sparse_compressed_tensor(
                    *parts, ref.shape, layout=layout, check_invariants=True
                )
        else:
            return None
        return tensor_pieces(tensor)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(
            f"{where}: torch cannot rebuild this {ref.layout} tensor from its parts ({e})",
            path=where,
        ) from e


def _read(reader: TensorReader, ref: TensorRef) -> torch.Tensor:
    """A part as torch.load gives it: its conjugate or negative bit applied."""
    return with_view_bits(reader.read(ref), ref.view_bits)


def _nested_pieces(
    buffer: torch.Tensor, sizes: torch.Tensor, strides: torch.Tensor, offsets: torch.Tensor
) -> Pieces:
    # torch's rebuild does not check the components against the buffer; this does, as the
    # loader does, before as_strided views the buffer's fresh, exact storage through them.
    check_nested_parts(buffer, sizes, strides, offsets)
    buffer = buffer.clone()
    components = tuple(
        buffer.as_strided(size, stride, offset)
        for size, stride, offset in zip(sizes.tolist(), strides.tolist(), offsets.tolist())
    )
    return Pieces((("component sizes", sizes.to(torch.int64)),), components)


def _jagged_pieces(reader: TensorReader, kwargs: dict[str, Any]) -> Pieces:
    values, offsets = _read(reader, kwargs["values"]), _read(reader, kwargs["offsets"])
    lengths = None if kwargs.get("lengths") is None else _read(reader, kwargs["lengths"])
    dim = kwargs.get("_ragged_idx", 1) - 1
    # torch's constructor does not check the offsets; its kernels index the values with them.
    check_jagged_parts(values, offsets, lengths, dim + 1)
    starts = offsets.tolist()
    if lengths is None:
        sizes = [end - start for start, end in pairwise(starts)]
    else:
        sizes = lengths.tolist()
    components = tuple(values.narrow(dim, a, n) for a, n in zip(starts, sizes))
    shapes = torch.tensor([list(c.shape) for c in components], dtype=torch.int64)
    return Pieces((("component sizes", shapes),), components)


def compare_pieces(
    base: TensorDiff, a: Pieces | None, b: Pieces | None, rtol: float, atol: float
) -> TensorDiff:
    """``base`` (same layout and shape on both sides) with its values compared.

    Index parts must be equal for the values to pair up; where they are not, the pair is
    reported as differing with a note, never as equal.

    Args:
        base: the pair's keys, dtypes, shapes and layouts.
        a: side A's pieces (None: a layout whose pieces are unknown).
        b: side B's.
        rtol: relative tolerance, as in ``torch.isclose``.
        atol: absolute tolerance.

    Returns:
        The comparison: ``bit_equal`` only where torch finds the two tensors equal.
    """
    if a is None or b is None:
        return replace(base, note=f"values of a {base.layout_a} tensor are not compared")
    for (name, ia), (_, ib) in zip(a.index, b.index):
        if ia.shape != ib.shape or not torch.equal(ia.cpu().long(), ib.cpu().long()):
            return replace(base, bit_equal=False, note=_index_note(base.layout_a, name))
    stats = ValueStats(base.dtype_a, base.dtype_b, rtol, atol)
    for va, vb in zip(a.values, b.values):
        if va.shape != vb.shape:  # BSR blocks of other sizes
            return replace(base, bit_equal=False, note="their value blocks differ in shape")
        stats.add(flat_cpu(va), flat_cpu(vb))
    return with_stats(base, stats)


def _index_note(layout: str, name: str) -> str:
    if layout == "nested":
        return "their components' sizes differ, so values were not compared"
    # Explicitly stored zeros are the one case where other indices still mean equal tensors.
    return (
        f"their {name} differ (they store other elements), so values were not compared; "
        "torch finds them equal only where the extra elements are explicit zeros"
    )
