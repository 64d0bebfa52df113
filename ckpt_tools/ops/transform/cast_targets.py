"""Which storages a cast changes: each one whose every tensor in the output is cast alike.

A storage is cast once for every tensor on it, so tied weights stay tied and views stay views
over the cast storage. One also used by a tensor that is not cast (a kept key, a tensor
outside the state dict, such as an optimizer's or an EMA's) is copied as it is, with a note.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ckpt_tools.descriptors import TensorRef, iter_tensors
from ckpt_tools.io.casting import CAST_SOURCES
from ckpt_tools.structure.selection import replace_at

__all__ = ["cast_targets", "kept_outside"]


def kept_outside(root: Any, path: Sequence[str]) -> set[int]:
    """The storages of the tensors outside the state dict at ``path`` (an optimizer's, an
    EMA's), which keep them: one of those is never cast."""
    return {id(t.storage) for _, t in iter_tensors(replace_at(root, path, {}))}


def cast_targets(
    tree: Any,
    items: Sequence[tuple[str, str | None, Any]],
    cast_to: str | None,
    keep: Sequence[re.Pattern[str]],
    notes: list[str],
    outside: set[int],
) -> dict[int, str]:
    """``id(storage)`` -> source dtype for every storage to cast (none in ``outside``: the
    storages of tensors outside the state dict, an optimizer's or an EMA's, kept as they are)."""
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
            or sid in outside
            or any(id(t) not in cast_ids or t.dtype != wanted[sid] for t in ts)
            or ts[0].storage.view
        ):
            why = (
                "a tensor outside the state dict shares it"
                if sid in outside
                else ("a tensor on it is not cast")
            )
            notes.append(f"storage {ts[0].storage.key!r} kept as {wanted[sid]}: {why}")
            del wanted[sid]
    return wanted
