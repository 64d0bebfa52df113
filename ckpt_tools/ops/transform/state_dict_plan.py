"""The plan that writes a state dict (slim, extract, average): copied and cast storages.

A storage is cast once for every tensor on it, so tied weights stay tied and views stay
views over the cast storage; one also used by a tensor that is not cast is copied as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import TensorRef, iter_tensors
from ckpt_tools.errors import ConversionError, NonTensorEntriesError, Remedy
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.casting import CAST_SOURCES
from ckpt_tools.io.tensor_bytes import check_plain_values
from ckpt_tools.io.writers.plan import Record
from ckpt_tools.ops.transform.plan import (
    PlanRow,
    TransformPlan,
    cast_storage_record,
    cast_tensor,
    categories,
    copy_record,
    execute_plan,
    new_storage,
    tensor_bytes_record,
)
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.structure.selection import Selection, replace_at

__all__ = ["finish", "plan_state_dict_output"]


def plan_state_dict_output(
    ckpt: Checkpoint,
    command: str,
    dst: str,
    fmt: str,
    selection: Selection,
    items: Sequence[tuple[str, str | None, Any]],
    *,
    weights_only: bool,
    root_out: Any = None,
    cast_to: str | None = None,
    keep: Sequence[re.Pattern[str]] = (),
    dropped_entries: Sequence[str] = (),
    notes: Sequence[str] = (),
    overrides: Mapping[int, Record] | None = None,
) -> TransformPlan:
    """The plan writing ``items`` (source key, output key or None to drop, value) as a state dict.

    Args:
        weights_only: the output is the state dict alone; else it replaces the selection
            inside ``root_out`` (the root with dropped entries removed).
        cast_to: cast eligible floating tensors to this dtype.
        keep: keys matching any of these keep their dtype.
        overrides: ``id(source storage)`` -> the record that makes it instead of a copy
            (a mean of N inputs), same dtype and size.
    """
    out_sd: dict[Any, Any] = (
        type(selection.state_dict)() if isinstance(selection.state_dict, dict) else {}
    )
    metadata = getattr(selection.state_dict, "_metadata", None)
    if metadata is not None:
        out_sd._metadata = metadata  # type: ignore[attr-defined]
    for _, new, value in items:
        if new is not None:
            out_sd[new] = value
    tree = out_sd if weights_only else replace_at(root_out, selection.path, out_sd)
    overrides = overrides or {}
    rows, notes = [], list(notes)
    targets = _cast_targets(tree, items, cast_to, keep, notes)
    records, out_storage, replaced = {}, {}, {}
    for _, t in iter_tensors(tree):
        sid = id(t.storage)
        if sid in out_storage:
            continue
        src_dtype = targets.get(sid)
        if src_dtype is None and t.func is None:
            # Read without a pickle (safetensors): give it torch.save's storage and rebuild.
            storage = new_storage(t.storage, t.dtype, t.storage.nbytes // _size(t.dtype))
            out_storage[sid] = storage
            records[id(storage)] = overrides.get(sid) or copy_record(ckpt, t.storage)
        elif src_dtype is None:
            out_storage[sid] = t.storage
            records[sid] = overrides.get(sid) or copy_record(ckpt, t.storage)
        else:
            numel = t.storage.nbytes // _size(src_dtype)
            storage = new_storage(t.storage, cast_to, numel)  # type: ignore[arg-type]
            out_storage[sid] = storage
            records[id(storage)] = cast_storage_record(ckpt, t.storage, src_dtype, cast_to)  # type: ignore[arg-type]
    for old, new, value in items:
        if not isinstance(value, TensorRef):
            continue
        cast = id(value.storage) in targets
        if new is not None and (cast or id(value.storage) in overrides):
            check_plain_values(new, value, f"a cast to {cast_to}" if cast else "a mean")
        if cast and new is not None:
            replaced[new] = cast_tensor(value, out_storage[id(value.storage)], cast_to)
        elif value.func is None and new is not None:
            replaced[new] = cast_tensor(value, out_storage[id(value.storage)], value.dtype)  # type: ignore[arg-type]
        after = replaced.get(new, value) if new is not None else None
        rows.append(
            PlanRow(
                old,
                new,
                value.dtype,
                after.dtype if after else None,
                value.nbytes,
                after.nbytes if after else 0,
                "drop" if new is None else (f"cast {value.dtype} -> {cast_to}" if cast else "copy"),
            )
        )
    for key, t in replaced.items():
        out_sd[key] = t
    expected = {k: v for k, v in out_sd.items() if isinstance(v, TensorRef)}
    size_before = categories(ckpt, ckpt.root, selection.path, selection.state_dict)
    if fmt == "safetensors":
        entries, st_meta = _safetensors_entries(
            overrides, ckpt, selection, items, weights_only, cast_to, targets
        )
        size_after = {"weights": sum(r.nbytes for _, _, r in entries), "optimizer": 0, "other": 0}
        expected = {name: t for name, t, _ in entries}
        return TransformPlan(
            command,
            (ckpt.path,),
            dst,
            fmt,
            None,
            {},
            tuple(entries),
            st_meta,
            expected,
            (),
            tuple(rows),
            tuple(dropped_entries),
            size_before,
            size_after,
            tuple(notes),
        )
    size_after = _sizes_after(tree, weights_only, records, out_sd, selection.path)
    return TransformPlan(
        command,
        (ckpt.path,),
        dst,
        fmt,
        tree,
        records,
        (),
        None,
        expected,
        () if weights_only else selection.path,
        tuple(rows),
        tuple(dropped_entries),
        size_before,
        size_after,
        tuple(notes),
    )


def _size(dtype: str) -> int:
    from ckpt_tools.dtypes import itemsize

    return itemsize(dtype)


def _cast_targets(
    tree: Any,
    items: Sequence[tuple[str, str | None, Any]],
    cast_to: str | None,
    keep: Sequence[re.Pattern[str]],
    notes: list[str],
) -> dict[int, str]:
    """``id(storage)`` -> source dtype for every storage to cast."""
    if cast_to is None:
        return {}
    wanted: dict[int, str] = {}
    for old, new, value in items:
        if new is None or not isinstance(value, TensorRef):
            continue
        if (
            value.dtype in CAST_SOURCES
            and value.dtype != cast_to
            and not any(p.search(old) for p in keep)
        ):
            wanted.setdefault(id(value.storage), value.dtype)
    # A storage is cast only when every tensor on it in the output is cast the same way.
    users: dict[int, list[TensorRef]] = {}
    for _, t in iter_tensors(tree):
        users.setdefault(id(t.storage), []).append(t)
    cast_ids = {
        id(v)
        for _, n, v in items
        if n is not None
        and isinstance(v, TensorRef)
        and id(v.storage) in wanted
        and not any(p.search(_) for p in keep)
    }
    # A kept key wins over a tie: the same tensor object (a tied Parameter, pickled once) may
    # be reached through a kept key and through a cast one, so keys are checked, not objects.
    kept = {
        id(v.storage)
        for old, n, v in items
        if n is not None and isinstance(v, TensorRef) and any(p.search(old) for p in keep)
    }
    for sid in list(wanted):
        ts = users.get(sid, [])
        if (
            sid in kept
            or any(id(t) not in cast_ids or t.dtype != wanted[sid] for t in ts)
            or ts[0].storage.view
        ):
            notes.append(
                f"storage {ts[0].storage.key!r} kept as {wanted[sid]}: a tensor on it is not cast"
            )
            del wanted[sid]
    return wanted


def _sizes_after(
    tree: Any,
    weights_only: bool,
    records: Mapping[int, Any],
    sd: Mapping[Any, Any],
    path: Sequence[str],
) -> dict[str, int]:
    sizes = {"weights": 0, "optimizer": 0, "other": 0}
    seen: set[int] = set()
    for value in sd.values():
        if isinstance(value, TensorRef) and id(value.storage) not in seen:
            seen.add(id(value.storage))
            sizes["weights"] += records[id(value.storage)].nbytes
    if not weights_only and isinstance(tree, Mapping):
        for name, value in tree.items():
            category = "optimizer" if str(name).startswith("optim") else "other"
            for _, t in iter_tensors(value):
                if id(t.storage) not in seen:
                    seen.add(id(t.storage))
                    sizes[category] += records[id(t.storage)].nbytes
    return sizes


def _safetensors_entries(
    overrides: Mapping[int, Record],
    ckpt: Checkpoint,
    selection: Selection,
    items: Sequence[tuple[str, str | None, Any]],
    weights_only: bool,
    cast_to: str | None,
    targets: Mapping[int, str],
):
    extras = [old for old, new, v in items if new is not None and not isinstance(v, TensorRef)]
    if not weights_only and isinstance(ckpt.root, Mapping) and selection.path:
        extras += [str(k) for k in ckpt.root if k != selection.path[0]]
    if extras:
        raise NonTensorEntriesError(
            "safetensors holds tensors only, and the output would also hold "
            f"{', '.join(extras[:8])}",
            tuple(extras),
            path=ckpt.path,
            remedies=(
                Remedy(
                    "weights_only",
                    "True",
                    flag="--weights-only",
                    text="to write the state dict alone",
                ),
            ),
        )
    metadata: dict[str, str] = {"format": "pt"}
    entries, kept = [], {}
    for _, new, t in items:
        if new is None:
            continue
        identity = (id(t.storage), t.offset, t.shape, t.stride)
        if identity in kept:  # tied: stored once, as safetensors' save_model does
            metadata[new] = kept[identity]
            continue
        kept[identity] = new
        dst = cast_to if id(t.storage) in targets else None
        record = overrides.get(id(t.storage)) or tensor_bytes_record(ckpt, t, dst)
        if id(t.storage) in overrides and (t.offset, t.nbytes) != (0, record.nbytes):
            raise ConversionError(
                f"{new!r} is a view of part of a storage; safetensors cannot hold the computed "
                "storage as it is",
                remedies=(Remedy("output_format", "'torch'", flag="--format torch"),),
            )
        out = TensorRef(t.storage, 0, t.shape, (), dst or t.dtype)
        entries.append((new, out, record))
    return entries, metadata


def finish(
    plan: TransformPlan,
    target: Any,
    ckpt: Checkpoint,
    verify: str,
    dry_run: bool,
    durable: bool = True,
) -> TransformResult:
    """Write the plan (unless ``dry_run``) and say what happened."""
    before = sum(plan.size_before.values())
    sizes = f"{before} -> {plan.output_bytes} tensor bytes"
    if dry_run:
        return TransformResult(
            plan, False, "", f"dry run: would write {plan.dst} ({sizes}); nothing written"
        )
    verification = execute_plan(plan, target, ckpt, verify, durable=durable)
    return TransformResult(plan, True, verification, f"{plan.command}: wrote {plan.dst} ({sizes})")
