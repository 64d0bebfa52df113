"""The records that make a merged tensor: the base weight read, merged, rounded once, yielded.

A record is made when the writer reaches it, so one merged tensor is in memory at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.formats import Checkpoint
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

__all__ = ["bias_record", "merge_record", "replace_record", "values"]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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


def merge_record(
    base: Checkpoint,
    weight: TensorRef,
    adapter: Checkpoint,
    target: LoraTarget,
    transpose: bool,
    start: TensorRef | None = None,
) -> Record:
    """The record of ``weight`` with ``target`` merged into it (LoRA or DoRA).

    ``start``: the adapter's own copy of the weight (``save_embedding_layers``), which PEFT
    loads into the base (rounded to its dtype) before merging.
    """

    def produce() -> Iterable[bytes]:
        a, b = values(adapter, target.a), values(adapter, target.b)
        delta_dtype = target.a.dtype if target.kind == "embedding" else target.b.dtype
        delta = lora_delta(a, b, target.scaling, transpose, delta_dtype)
        w = values(base, weight) if start is None else rounded(values(adapter, start), weight.dtype)
        if target.kind == "embedding":
            # Embedding.merge rounds the delta to the weight's dtype before adding it.
            delta, delta_dtype = rounded(delta, weight.dtype), weight.dtype
        if target.magnitude is None:
            out = plain_merge(w, weight.dtype, delta, delta_dtype)
        else:
            m = values(adapter, target.magnitude)
            out = dora_merge(
                w, weight.dtype, delta, delta_dtype, m, target.magnitude.dtype, transpose
            )
        yield to_bits(out, weight.dtype)

    return Record(weight.nbytes, produce=produce, action=f"merge lora r={target.r}")


def bias_record(
    base: Checkpoint, bias: TensorRef, adapter: Checkpoint, target: LoraTarget
) -> Record:
    """The record of ``bias + lora_B.bias * scaling`` (``lora_bias=True``)."""
    assert target.bias is not None
    lora_bias = target.bias

    def produce() -> Iterable[bytes]:
        scaled = values(adapter, lora_bias) * np.float32(target.scaling)
        scaled = rounded(scaled, lora_bias.dtype)
        yield to_bits(
            plain_merge(values(base, bias), bias.dtype, scaled, lora_bias.dtype), bias.dtype
        )

    return Record(bias.nbytes, produce=produce, action="merge lora bias")


def replace_record(adapter: Checkpoint, saved: TensorRef, like: TensorRef) -> Record:
    """The record of a ``modules_to_save`` copy in the base tensor's dtype (torch's ``copy_``)."""
    record = tensor_bytes_record(adapter, saved, like.dtype if saved.dtype != like.dtype else None)
    return replace(record, action="replace (modules_to_save)")
