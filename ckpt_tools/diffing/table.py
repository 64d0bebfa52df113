"""The table of differing tensors in a :class:`~ckpt_tools.diffing.report.DiffReport`'s text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckpt_tools.structure.grouping import group_names

if TYPE_CHECKING:
    from ckpt_tools.diffing.parts import TensorDiff

__all__ = ["DIFF_COLUMNS", "diff_rows"]

#: The columns of the differing-tensors table.
DIFF_COLUMNS = (
    "name",
    "status",
    "dtype",
    "shape",
    "max abs",
    "max rel",
    "mismatched",
    "NaN A/B",
    "inf A/B",
)


def _number(x: float | None) -> str:
    if x is None:
        return ""
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.3g}"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "uninitialized" if shape is None else str(list(shape))


def diff_rows(tensors: Sequence[TensorDiff], group: bool) -> list[list[str]]:
    """Table cells under :data:`DIFF_COLUMNS`; a folded row reports its members' worst."""

    def signature(t: TensorDiff) -> Any:
        return (t.status, t.dtype_a, t.dtype_b, t.shape_a, t.shape_b)

    groups = (
        [(g.label, members) for g, members in group_names(tensors, lambda t: t.name, signature)]
        if group
        else [(t.name, [t]) for t in tensors]
    )
    return [_row(label, members) for label, members in groups]


def _row(label: str, members: Sequence[TensorDiff]) -> list[str]:
    first = members[0]
    same_dtype, same_shape = first.dtype_a == first.dtype_b, first.shape_a == first.shape_b
    abs_values = [t.max_abs for t in members if t.max_abs is not None]
    rel_values = [t.max_rel for t in members if t.max_rel is not None]
    mismatched = [t.mismatched for t in members if t.mismatched is not None]
    nan = (sum(t.nan_a for t in members), sum(t.nan_b for t in members))
    inf = (sum(t.inf_a for t in members), sum(t.inf_b for t in members))
    return [
        label,
        first.status,
        first.dtype_a if same_dtype else f"{first.dtype_a} / {first.dtype_b}",
        _shape(first.shape_a)
        if same_shape
        else f"{_shape(first.shape_a)} / {_shape(first.shape_b)}",
        _number(max(abs_values)) if abs_values else "",
        _number(max(rel_values)) if rel_values else "",
        str(sum(mismatched)) if mismatched else "",
        f"{nan[0]}/{nan[1]}" if any(nan) else "",
        f"{inf[0]}/{inf[1]}" if any(inf) else "",
    ]
