"""Which storages a cast changes: each one whose every tensor in the output is cast alike.

A storage is cast once for every tensor on it, so tied weights stay tied and views stay views
over the cast storage. One also used by a tensor that is not cast (a kept key, a tensor
outside the state dict, such as an optimizer's or an EMA's) is copied as it is, with a note.
A sparse or nested tensor (a jagged one too) is cast by its values part's storage (its
indices never are).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.io.casting import CAST_SOURCES
from ckpt_tools.ops.transform.plan import DROPPED, Item
from ckpt_tools.ops.transform.rebuilt_cast import values_part
from ckpt_tools.structure.paths import key_text
from ckpt_tools.structure.selection import replace_at
from ckpt_tools.structure.tensor_walk import iter_stored_tensors, quantizer_tensors, stored_views

__all__ = ["cast_targets", "kept_outside"]


def kept_outside(root: Any, path: Sequence[str]) -> set[int]:
    """The storages of the tensors outside the state dict at ``path`` (an optimizer's, an
    EMA's), which keep them: one of those is never cast."""
    return {id(t.storage) for _, t in iter_stored_tensors(replace_at(root, path, {}))}


def _cast_view(value: Any) -> TensorRef | None:
    """The view a cast of ``value`` changes: a dense tensor, or a sparse or nested tensor's
    values part; None for anything else (a meta tensor has no storage)."""
    if isinstance(value, TensorRef):
        return value
    if isinstance(value, RebuiltTensor):
        return values_part(value)
    return None


def cast_targets(
    views: Mapping[int, Sequence[TensorRef]],
    items: Sequence[Item],
    cast_to: str | None,
    keep: Sequence[re.Pattern[str]],
    notes: list[str],
    outside: set[int],
) -> dict[int, str]:
    """``id(storage)`` -> source dtype for every storage to cast (none in ``outside``: the
    storages of tensors outside the state dict, an optimizer's or an EMA's, kept as they are).
    ``views``: each output storage's tensors, as
    :func:`~ckpt_tools.structure.tensor_walk.storage_views` gives them for the output tree."""
    if cast_to is None:
        return {}
    kept_key = [any(p.search(key_text(old)) for p in keep) for old, _, _ in items]
    # The views cast: dense tensors and values parts, of a castable dtype, under a cast key.
    cast_views = [
        view
        for (_, new, value), kept in zip(items, kept_key)
        if new is not DROPPED
        and not kept
        and (view := _cast_view(value)) is not None
        and view.dtype in CAST_SOURCES
        and view.dtype != cast_to
    ]
    wanted: dict[int, str] = {}
    for view in cast_views:
        wanted.setdefault(id(view.storage), view.dtype)
    # A storage is cast only when every tensor on it in the output is cast the same way.
    cast_ids = {id(v) for v in cast_views}
    # A kept key wins over a tie: the same tensor object (a tied Parameter, pickled once) may
    # be reached through a kept key and through a cast one, so keys are checked, not objects.
    kept = {
        id(t.storage)
        for (_, n, v), k in zip(items, kept_key)
        if n is not None and k
        for t in stored_views(v)
    }
    # A quantizer's scales are never cast, whichever key shares their storage.
    kept.update(id(q.storage) for ts in views.values() for t in ts for q in quantizer_tensors(t))
    for sid in list(wanted):
        ts = views.get(sid, [])
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
