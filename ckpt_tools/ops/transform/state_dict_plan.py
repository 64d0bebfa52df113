"""The plan that writes a state dict (slim, extract, average): copied and cast storages.

Which storages are cast is :mod:`~ckpt_tools.ops.transform.cast_targets`' choice; each is
cast once, for every tensor on it, each tensor's run as torch casts it
(:mod:`~ckpt_tools.ops.transform.view_casts`). Sparse, nested and meta tensors are written
too: their parts' storages copied (or their values cast,
:mod:`~ckpt_tools.ops.transform.rebuilt_cast`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools._types import Progress, VerifyLevel
from ckpt_tools.descriptors import RebuiltTensor, StorageRef, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import ConversionError, Remedy
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import (
    Record,
    copy_record,
)
from ckpt_tools.io.writers.saved_tensors import saved_storage, saved_tensor
from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor, dry_run_fields
from ckpt_tools.ops.rewrite.plan import torch_instead
from ckpt_tools.ops.transform.cast_targets import cast_targets, kept_outside
from ckpt_tools.ops.transform.plan import (
    DROPPED,
    Item,
    PlanRow,
    TransformPlan,
    categories,
    check_computable,
    execute_plan,
    sizes_after,
)
from ckpt_tools.ops.transform.rebuilt_cast import cast_rebuilt_items
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.ops.transform.safetensors_entries import safetensors_entries, safetensors_plan
from ckpt_tools.ops.transform.view_casts import storage_cast_record
from ckpt_tools.structure.attributes import carry_attributes
from ckpt_tools.structure.keys import KeyRule
from ckpt_tools.structure.selection import Selection, holds_no_state_dict, replace_at
from ckpt_tools.structure.tensor_walk import storage_views

__all__ = ["finish", "plan_state_dict_output"]

# What makes a storage an operation computes (its ``overrides``), in words.
_COMPUTED = {"average": "a mean", "merge-lora": "a LoRA merge"}


def plan_state_dict_output(
    ckpt: Checkpoint,
    command: str,
    dst: str,
    fmt: str,
    selection: Selection,
    items: Sequence[Item],
    *,
    weights_only: bool,
    drop_extras: bool = False,
    root_out: Any = None,
    cast_to: str | None = None,
    keep: Sequence[re.Pattern[str]] = (),
    dropped_entries: Sequence[str] = (),
    notes: Sequence[str] = (),
    overrides: Mapping[int, Record] | None = None,
    to_torch: Remedy | None = None,
    renames: Sequence[KeyRule] = (),
) -> TransformPlan:
    """The plan writing ``items`` (source key, output key or :data:`DROPPED`, value).

    Args:
        weights_only: the output is the state dict alone; else it replaces the selection
            inside ``root_out`` (the root with dropped entries removed).
        drop_extras: a safetensors output leaves out non-tensor entries instead of
            refusing them.
        cast_to: cast eligible floating tensors to this dtype.
        keep: keys matching any of these keep their dtype.
        overrides: ``id(source storage)`` -> the record that makes it instead of a copy
            (a mean of N inputs), same dtype and size.
        to_torch: the fix said where safetensors cannot hold a computed storage (default:
            :func:`~ckpt_tools.ops.rewrite.plan.torch_instead` of ``dst``).
        renames: the rules that made the output keys (extract's strip), applied to the
            module paths of ``_metadata`` as torch renames them.
    """
    if selection.stand_in:  # written in place of the root, the empty stand-in would drop it
        raise ConversionError(
            f"{holds_no_state_dict(repr(ckpt.path), ckpt.root)}; {command} rewrites a state dict"
        )
    out_sd = _output_state_dict(selection, items, renames)
    tree = out_sd if weights_only else replace_at(root_out, selection.path, out_sd)
    overrides = overrides or {}
    notes = list(notes)
    # A tensor outside the state dict that shares a storage keeps it uncast; a safetensors
    # output holds none of them (left out with drop_extras, else refused).
    alone = weights_only or cast_to is None or fmt == "safetensors"
    outside = set() if alone else kept_outside(root_out, selection.path)
    # A sparse or nested tensor's parts too; a safetensors output holds the state dict alone.
    views = storage_views(out_sd if fmt == "safetensors" else tree)
    targets = cast_targets(views, items, cast_to, keep, notes, outside)
    records, out_storage = _storage_records(ckpt, views, targets, cast_to, overrides)
    rebuilt = cast_rebuilt_items(items, out_storage, targets, cast_to, keep, notes)
    computed = _COMPUTED.get(command, f"{command}'s computation")
    rows, replaced = _rows(items, out_storage, targets, overrides, cast_to, rebuilt, computed)
    out_sd.update(replaced)
    shared: dict[str, Any] = {
        "command": command,
        "sources": (ckpt.path,),
        "dst": dst,
        "output_format": fmt,
        "rows": tuple(rows),
        "dropped_entries": tuple(dropped_entries),
        "size_before": categories(ckpt, ckpt.root, selection.path, selection.state_dict),
        "notes": tuple(notes),
        "selected": tuple(selection.path),
    }
    if fmt == "safetensors":
        kept_root = ckpt.root if root_out is None else root_out  # (entries dropped by name gone)
        found = safetensors_entries(
            overrides,
            ckpt,
            kept_root,
            selection,
            items,
            weights_only,
            drop_extras,
            cast_to,
            targets,
            to_torch or torch_instead(dst),
        )
        return safetensors_plan(shared, *found)
    return TransformPlan(
        **shared,
        tree=tree,
        records=records,
        entries=(),
        metadata=None,
        expected={k: v for k, v in out_sd.items() if isinstance(v, (TensorRef, RebuiltTensor))},
        select_out=() if weights_only else selection.path,
        size_after=sizes_after(tree, weights_only, records, out_sd),
    )


def _output_state_dict(
    selection: Selection, items: Sequence[Item], renames: Sequence[KeyRule]
) -> dict[Any, Any]:
    """The output state dict: the kept items under their new keys, of the selection's type,
    its attributes kept, ``_metadata`` (module versions) renamed by ``renames`` as torch
    renames it."""
    sd = selection.state_dict
    out_sd: dict[Any, Any] = type(sd)() if isinstance(sd, dict) else {}
    carry_attributes(sd, out_sd, renames)
    for _, new, value in items:
        if new is not DROPPED:
            out_sd[new] = value
    return out_sd


def _storage_records(
    ckpt: Checkpoint,
    views: Mapping[int, Sequence[TensorRef]],
    targets: Mapping[int, str],
    cast_to: str | None,
    overrides: Mapping[int, Record],
) -> tuple[dict[int, Record], dict[int, StorageRef]]:
    """One record per output storage, and each source storage's output storage.

    ``views``: each storage's tensors in the output tree, first met first.

    Returns:
        ``id(output storage)`` -> its record, and ``id(source storage)`` -> output storage.
    """
    records: dict[int, Record] = {}
    out_storage: dict[int, StorageRef] = {}
    for sid, on_it in views.items():
        t = on_it[0]
        src_dtype = targets.get(sid)
        if src_dtype is not None and cast_to is not None:
            storage = saved_storage(t.storage, cast_to, t.storage.nbytes // itemsize(src_dtype))
            records[id(storage)] = storage_cast_record(
                ckpt, t.storage, src_dtype, cast_to, on_it, overrides.get(sid)
            )
        elif t.func is None:
            # Read without a pickle (safetensors): give it torch.save's storage and rebuild.
            storage = saved_storage(t.storage, t.dtype)
            records[id(storage)] = overrides.get(sid) or copy_record(ckpt, t.storage)
        else:
            storage = t.storage
            records[sid] = overrides.get(sid) or copy_record(ckpt, t.storage)
        out_storage[sid] = storage
    return records, out_storage


def _rows(
    items: Sequence[Item],
    out_storage: Mapping[int, StorageRef],
    targets: Mapping[int, str],
    overrides: Mapping[int, Record],
    cast_to: str | None,
    rebuilt: Mapping[str, RebuiltTensor],
    computed: str,
) -> tuple[list[PlanRow], dict[str, Any]]:
    """One row per tensor item, and the output tensors that differ from the input's.

    A tensor on a cast storage is described as ``cast_to``; one read without a pickle gets
    torch.save's rebuild call on its output storage. ``rebuilt``: the sparse, nested and
    meta tensors cast (by output key). ``computed``: what makes an overridden storage, in
    words (``a mean``).
    """
    rows: list[PlanRow] = []
    replaced: dict[str, Any] = {}
    for old, new, value in items:
        if isinstance(value, RebuiltTensor):
            after = None if new is DROPPED else rebuilt.get(new, value)
            rows.append(_row(old, new, value, after, cast_to))
            if new is not DROPPED and after is not value:
                replaced[new] = after
            continue
        if not isinstance(value, TensorRef):
            continue
        cast = id(value.storage) in targets
        if new is not DROPPED and (cast or id(value.storage) in overrides):
            doing = f"a cast to {cast_to}" if cast else computed
            check_computable(new, value, doing, cast=cast)
        if new is not DROPPED and (cast or value.func is None):
            dtype = cast_to if cast and cast_to is not None else value.dtype
            replaced[new] = saved_tensor(value, out_storage[id(value.storage)], dtype)
        after = replaced.get(new, value) if new is not DROPPED else None
        rows.append(_row(old, new, value, after, cast_to))
    return rows, replaced


def _row(old: Any, new: Any, value: Any, after: Any, cast_to: str | None) -> PlanRow:
    """The row of one tensor (dense, sparse, nested or meta): dropped, copied or cast."""
    if new is DROPPED:
        action = "drop"
    elif after.dtype != value.dtype:
        action = f"cast {value.dtype} -> {cast_to}"
    else:
        action = "copy"
    return PlanRow.of(
        old,
        new,
        value.dtype,
        after.dtype if after is not None else None,
        value.nbytes,
        after.nbytes if after is not None else 0,
        action,
    )


def finish(
    plan: TransformPlan,
    target: Any,
    ckpt: Checkpoint,
    verify: VerifyLevel,
    dry_run: bool,
    durable: bool = True,
    progress: Progress | None = None,
    *,
    replace: bool = False,
) -> TransformResult:
    """Write the plan (unless ``dry_run``) and say what happened.

    ``verify``, ``dry_run``, ``durable`` and ``progress`` are the transform's own, as
    :func:`~ckpt_tools.ops.transform.slim.slim` documents them; ``replace`` is its ``force``
    (a ``target`` that exists is replaced only then).
    """
    if plan.output_format == "safetensors":
        records = [r for _, _, r in plan.entries]
        planned = PlannedFile.of(plan.dst, (PlannedTensor.of(k, t) for k, t, _ in plan.entries))
    else:
        records = list(plan.records.values())
        planned = PlannedFile.of_tree(plan.dst, plan.tree)
    rows_dropped = tuple(r.source_key for r in plan.rows if r.dropped)
    sizes = f"{sum(plan.size_before.values())} -> {plan.output_bytes} tensor bytes"
    shared: dict[str, Any] = {
        "src": plan.sources[0],
        "dst": plan.dst,
        "input_format": ckpt.format,
        "output_format": plan.output_format,
        "bytes_written": plan.output_bytes,
        "bytes_copied": sum(r.nbytes for r in records if r.action.startswith("copy")),
        "notes": plan.notes,
        "dropped": plan.dropped_entries + rows_dropped,
        "selected": plan.selected,
        "tensors": sum(1 for r in plan.rows if not r.dropped),
        "renamed": sum(1 for r in plan.rows if not r.dropped and r.key != r.source_key),
        "command": plan.command,
        "sources": plan.sources,
        "rows": plan.rows,
        "size_before": plan.size_before,
        "size_after": plan.size_after,
        "plan": plan,
    }
    if dry_run:
        message = f"dry run: would write {plan.dst} ({sizes})"
        return TransformResult(**shared, **dry_run_fields(plan.dst, (planned,)), message=message)
    counter = ByteCounter(progress, plan.output_bytes)
    verification = execute_plan(
        plan, target, ckpt, verify, counter, durable=durable, replace=replace
    )
    return TransformResult(
        **shared,
        written=(plan.dst,),
        verification=verification,
        message=f"{plan.command}: wrote {plan.dst} ({sizes})",
    )
