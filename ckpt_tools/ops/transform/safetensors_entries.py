"""A state dict's plan written as safetensors (slim, extract, average, merge-lora): its
entries, their records, and what a safetensors file cannot hold."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import ConversionError, Remedy
from ckpt_tools.formats import Checkpoint
from ckpt_tools.formats.safetensors import tie_metadata
from ckpt_tools.io.row_layout import row_layout, row_major_stream
from ckpt_tools.io.writers.records import Record, cast_stream, record_bytes, tensor_bytes_record
from ckpt_tools.io.writers.safetensors import (
    check_holdable,
    leave_out_extras,
    tensor_attributes,
    unholdable_kind,
)
from ckpt_tools.io.writers.safetensors_checks import tied_names
from ckpt_tools.ops.transform.plan import DROPPED, Item, TransformPlan
from ckpt_tools.structure.selection import Selection

__all__ = ["safetensors_entries", "safetensors_plan"]


def safetensors_plan(
    shared: dict[str, Any],
    entries: Sequence[tuple[str, TensorRef, Record]],
    metadata: dict[str, str],
    left_out: tuple[str, ...],
) -> TransformPlan:
    """The plan of a safetensors output: its entries, and what was left out of it."""
    shared = {**shared, "dropped_entries": shared["dropped_entries"] + left_out}
    return TransformPlan(
        **shared,
        tree=None,
        records={},
        entries=tuple(entries),
        metadata=metadata,
        expected={name: t for name, t, _ in entries},
        select_out=(),
        size_after={"weights": sum(r.nbytes for _, _, r in entries), "optimizer": 0, "other": 0},
    )


def safetensors_entries(
    overrides: Mapping[int, Record],
    ckpt: Checkpoint,
    root: Any,
    selection: Selection,
    items: Sequence[Item],
    weights_only: bool,
    drop_extras: bool,
    cast_to: str | None,
    targets: Mapping[int, str],
    to_torch: Remedy,
) -> tuple[list[tuple[str, TensorRef, Record]], dict[str, str], tuple[str, ...]]:
    """The entries of a safetensors output of ``items`` (non-tensor entries left out or
    refused, ties stored once, computed storages in row-major order, casts made), its
    metadata, and the names left out of it.

    Raises:
        NonTensorEntriesError: entries that are not tensors, without ``drop_extras``.
        ConversionError: a tensor safetensors cannot hold, or a computed storage seen
            through a partial or strided view.
    """
    inside = [old for old, new, v in items if new is not DROPPED and not isinstance(v, TensorRef)]
    # Sparse, nested and meta tensors are named as tensors safetensors cannot hold.
    kinds = {old: k for old, new, v in items if new is not DROPPED and (k := unholdable_kind(v))}
    beside: list[str] = []
    outside: set[str] = set()  # the tensors among them, named as tensors outside the state dict
    if not weights_only and isinstance(root, Mapping) and selection.path:
        beside = [str(k) for k in root if k != selection.path[0]]
        outside = {
            str(k)
            for k, v in root.items()
            if k != selection.path[0] and isinstance(v, (TensorRef, RebuiltTensor))
        }
    attributes = tensor_attributes((old, v) for old, new, v in items if new is not DROPPED)
    alone = Remedy(
        "weights_only", "True", flag="--weights-only", text="to write the state dict alone"
    )
    left_out = leave_out_extras(
        inside + beside,
        ckpt.path,
        drop_extras=drop_extras,
        remedies=(alone,) if beside and not inside else (),
        kinds=kinds,
        outside=outside,
    ) + tuple(attributes)  # a tensor's Python attributes: left out and listed, not refused
    metadata: dict[str, str] = {"format": "pt"}
    named = [(new, t) for _, new, t in items if new is not DROPPED and isinstance(t, TensorRef)]
    ties = tied_names(named)  # stored once
    entries = []
    for new, t in named:
        if new in ties:
            continue
        dst = cast_to if id(t.storage) in targets else None
        record = overrides.get(id(t.storage)) or tensor_bytes_record(ckpt, t, dst)
        if id(t.storage) in overrides:
            record = _row_major(new, t, record, to_torch)
        if dst is not None and id(t.storage) in overrides:  # a computed storage, then cast
            record = cast_stream(record, t.dtype, dst)
        # The rebuild call is kept, so the writer's guard sees a view bit as planning does.
        out = replace(t, offset=0, stride=(), dtype=dst or t.dtype)
        entries.append((new, out, record))
    check_holdable([(name, out) for name, out, _ in entries], ckpt.path, (to_torch,))
    metadata.update(tie_metadata(ties, beside=metadata))
    return entries, metadata, left_out + tuple(ties)  # reported as convert reports them


def _row_major(name: str, t: TensorRef, record: Record, to_torch: Remedy) -> Record:
    """A computed storage's record (its bytes in storage order) as the row-major entry of
    ``t``, which covers it: reordered row by row where ``t`` is ``channels_last``.

    Raises:
        ConversionError: ``t`` is a view of part of it, or strided otherwise.
    """
    if (t.offset, t.nbytes) != (0, record.nbytes) or row_layout(t) is None:
        raise ConversionError(
            f"{name!r} is a view of part of a storage, or a strided one; safetensors cannot "
            "hold the computed storage as it is",
            remedies=(to_torch,),
        )
    if t.is_contiguous():
        return record

    def produce() -> Iterable[bytes]:
        return row_major_stream(record_bytes(record), t)

    return Record(record.nbytes, produce=produce, action=record.action)
