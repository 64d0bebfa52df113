"""The records that make a merged tensor: the base weight read, merged, rounded once, yielded.

A record is made when the writer reaches it, so one merged tensor is in memory at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.row_layout import from_row_major, permuted_layout, to_row_major
from ckpt_tools.io.tensor_bytes import iter_row_major
from ckpt_tools.io.writers.records import Record, tensor_bytes_record
from ckpt_tools.ops.merge.adapter import LoraTarget
from ckpt_tools.ops.merge.arithmetic import (
    dora_merge,
    from_bits,
    lora_delta,
    plain_merge,
    rounded,
    to_bits,
)

__all__ = ["MergeStep", "bias_record", "lora_dtype", "merge_record", "replace_record", "values"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Elements merged at once: a few arrays of this size (float64 among them) are in memory.
_BLOCK = 1 << 20


def values(ckpt: Checkpoint, t: TensorRef) -> np.ndarray:
    """``t``'s values in row-major order, as float32 (float64 stays float64), shaped."""
    span = ckpt.span(t.storage)
    fd = os.open(span.path, os.O_RDONLY)
    try:
        data = b"".join(iter_row_major(fd, span.offset, t))
    finally:
        os.close(fd)
    size = t.nbytes // max(t.numel, 1)
    bits = np.frombuffer(data, dtype=np.dtype(_UINT[size]).newbyteorder("<")).astype(_UINT[size])
    return from_bits(bits, t.dtype).reshape(t.shape)


def _in_memory_order(t: TensorRef, like: TensorRef) -> TensorRef:
    """A view of ``t`` (of ``like``'s shape) whose row-major order is ``like``'s memory order:
    its elements written back to back fill ``like``'s storage as ``like`` lays them out."""
    layout = permuted_layout(like)
    if layout is None:
        return t
    dims = (0, *layout)
    shape = tuple(t.shape[d] for d in dims)
    return replace(t, shape=shape, stride=tuple(t.stride[d] for d in dims))


def rows(ckpt: Checkpoint, t: TensorRef, first: int, count: int) -> np.ndarray:
    """Rows ``[first, first + count)`` of a whole tensor whose rows lie back to back
    (:func:`~ckpt_tools.io.row_layout.row_layout`), as float32, each row its elements past
    the first dimension in row-major order (a convolution's kernels, flattened)."""
    size = t.nbytes // max(t.numel, 1)
    elements = _row_length(t)
    width = elements * size
    span = ckpt.span(t.storage)
    fd = os.open(span.path, os.O_RDONLY)
    try:
        data = os.pread(fd, count * width, span.offset + t.offset * size + first * width)
    finally:
        os.close(fd)
    if len(data) != count * width:
        raise OSError(5, f"{span.path} ended early")
    bits = np.frombuffer(data, dtype=np.dtype(_UINT[size]).newbyteorder("<")).astype(_UINT[size])
    return to_row_major(from_bits(bits, t.dtype).reshape(count, elements), t)


def _row_length(t: TensorRef) -> int:
    return t.numel // t.shape[0] if t.shape[0] else 0


@dataclass(frozen=True)
class MergeStep:
    """One target merged into a weight: the target, and whether its delta is transposed
    (``Conv1D``, embeddings)."""

    target: LoraTarget
    transpose: bool


def merge_record(
    base: Checkpoint,
    weight: TensorRef,
    adapter: Checkpoint,
    steps: Sequence[MergeStep],
    start: TensorRef | None = None,
) -> Record:
    """The record of ``weight`` with each step's target merged into it in turn (LoRA or DoRA).

    Several steps merge targets that share one weight (tied embeddings): PEFT merges each
    module in the model's order, each rounded to the weight's dtype before the next.
    Made in blocks of rows, each element computed as it would be over the whole tensor,
    so memory stays a few blocks whatever the weight's size; DoRA over a transposed
    (``Conv1D``, embedding) weight needs whole columns, and merges the tensor at once.
    ``start``: the adapter's own copy of the weight (``save_embedding_layers``), which PEFT
    loads into the base (rounded to its dtype) before merging.
    """
    whole = any(s.target.magnitude is not None and s.transpose for s in steps)
    height, width = weight.shape[0], _row_length(weight)
    block = height if whole else max(1, _BLOCK // max(width, 1))
    lora = lora_dtype(weight.dtype)

    def produce() -> Iterable[bytes]:
        loaded = [_step_tensors(adapter, s.target, lora) for s in steps]
        for first in range(0, height, block):
            count = min(block, height - first)
            if start is None:
                w = rows(base, weight, first, count)
            else:
                w = rounded(rows(adapter, start, first, count), weight.dtype)
            for step, (a, b, m) in zip(steps, loaded):
                part, mm = _block_of(a, b, m, first, count, step.transpose, whole)
                merged = _merged(w, weight.dtype, step.target, part, mm, step.transpose)
                w = rounded(merged, weight.dtype)
            yield to_bits(from_row_major(w, weight), weight.dtype)

    return Record(weight.nbytes, produce=produce, action=f"merge lora r={steps[0].target.r}")


def _step_tensors(
    adapter: Checkpoint, target: LoraTarget, lora: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    # A convolution's kernels merge as the rows of a matrix: B (out, r) @ A (r, in * kernel).
    a, b = (rounded(values(adapter, t), lora).reshape(t.shape[0], -1) for t in (target.a, target.b))
    m = None if target.magnitude is None else rounded(values(adapter, target.magnitude), lora)
    return a, b, None if m is None else m.reshape(-1)


def _block_of(
    a: np.ndarray,
    b: np.ndarray,
    m: np.ndarray | None,
    first: int,
    count: int,
    transpose: bool,
    whole: bool,
) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray | None]:
    """The parts of A, B and the magnitude that a block of W's rows needs."""
    # A block of W's rows is a block of B's rows, or (transposed) of A's columns.
    if whole:
        return (a, b), m
    if transpose:
        return (a[:, first : first + count], b), m
    return (a, b[first : first + count]), None if m is None else m[first : first + count]


def lora_dtype(weight_dtype: str) -> str:
    """The dtype of the adapter's layers when PEFT merges it into a weight of this dtype.

    ``PeftModel.from_pretrained`` makes each LoRA layer in its base layer's dtype and, by
    default (``autocast_adapter_dtype=True``), upcasts a 16-bit one to float32; the saved
    values are then copied in. So the file's dtype does not matter: a bfloat16 adapter on a
    float32 base merges in float32, as does any adapter on a 16-bit base.

    Example:
        >>> lora_dtype("bfloat16"), lora_dtype("float32"), lora_dtype("float64")
        ('float32', 'float32', 'float64')
    """
    return "float64" if weight_dtype == "float64" else "float32"


def _merged(
    w: np.ndarray,
    w_dtype: str,
    target: LoraTarget,
    ab: tuple[np.ndarray, np.ndarray],
    m: np.ndarray | None,
    transpose: bool,
) -> np.ndarray:
    """One block of rows merged: PEFT's delta, then the plain or DoRA merge."""
    delta_dtype = lora_dtype(w_dtype)
    delta = lora_delta(ab[0], ab[1], target.scaling, transpose, delta_dtype)
    if target.rounds_delta and m is None:
        # Embedding.merge (and the MiCA variant's) rounds a plain delta to the weight's
        # dtype before adding it (the DoRA variant does not).
        delta, delta_dtype = rounded(delta, w_dtype), w_dtype
    if m is None or target.magnitude is None:
        return plain_merge(w, w_dtype, delta, delta_dtype)
    return dora_merge(w, w_dtype, delta, delta_dtype, m, delta_dtype, transpose)


def bias_record(
    base: Checkpoint,
    bias: TensorRef,
    adapter: Checkpoint,
    target: LoraTarget,
    start: TensorRef | None = None,
) -> Record:
    """The record of ``bias + lora_B.bias * scaling`` (``lora_bias=True``).

    ``start``: the adapter's trained bias (``bias="lora_only"`` or ``"all"``), which PEFT
    loads into the base's (rounded to its dtype) before merging.
    """
    assert target.bias is not None
    lora_bias = target.bias

    lora = lora_dtype(bias.dtype)

    def produce() -> Iterable[bytes]:
        scaled = rounded(values(adapter, lora_bias), lora)
        scaled = scaled * scaled.dtype.type(target.scaling)
        b = values(base, bias) if start is None else rounded(values(adapter, start), bias.dtype)
        yield to_bits(plain_merge(b, bias.dtype, scaled, lora), bias.dtype)

    return Record(bias.nbytes, produce=produce, action="merge lora bias")


def replace_record(
    adapter: Checkpoint, saved: TensorRef, like: TensorRef, why: str = "modules_to_save"
) -> Record:
    """The record of a tensor the adapter saved whole (a ``modules_to_save`` copy, a trained
    bias) in the base tensor's dtype and layout, as loading copies it in (torch's ``copy_``)."""
    cast = like.dtype if saved.dtype != like.dtype else None
    record = tensor_bytes_record(adapter, _in_memory_order(saved, like), cast)
    return replace(record, action=f"replace ({why})")
