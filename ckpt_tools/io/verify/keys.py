"""The written tensors' keys read back and checked against the planned ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_tools.errors import VerificationError

__all__ = ["as_planned_keys"]


def as_planned_keys(
    got: Mapping[Any, Any], planned: Mapping[Any, Any], *, safetensors: bool
) -> dict[Any, Any]:
    """The tensors read back under the planned key objects, checked to be the planned keys.

    Keys compare with their types (``0`` and ``"0"`` are two keys, and ``1`` must not come
    back ``True``), in order where the format keeps one (a safetensors header is a JSON
    object, which its readers list sorted).

    Args:
        got: key -> tensor, as the written file reads back.
        planned: key -> source tensor, as the plan meant them.
        safetensors: the output is a safetensors file, whose metadata may add tied names.

    Returns:
        ``got`` keyed by ``planned``'s key objects.

    Raises:
        VerificationError: the keys differ; up to three missing and three unexpected named.

    Example:
        >>> nan = float("nan")
        >>> as_planned_keys({float("nan"): 1, "w": 2}, {nan: 0, "w": 0}, safetensors=False)
        {nan: 1, 'w': 2}
    """
    got = _as_planned(got, planned)
    if safetensors:
        got = _without_unplanned_aliases(got, planned)
    have, want = [(type(k), k) for k in got], [(type(k), k) for k in planned]
    if safetensors:
        have, want = sorted(have, key=repr), sorted(want, key=repr)
    if have != want:
        missing = [k for k in planned if k not in got][:3]
        extra = [k for k in got if k not in planned][:3]
        raise VerificationError(
            f"the written file's keys differ from the planned ones (missing {missing}, "
            f"unexpected {extra})"
        )
    return got


def _as_planned(got: Mapping[Any, Any], planned: Mapping[Any, Any]) -> dict[Any, Any]:
    """``got`` under the planned key objects. A key holding NaN (torch keeps one, or two) is
    equal to no other object, itself aside: each planned key stands for the next one read
    back that reads the same, in order. Spelled only where a key is not found as it is."""
    if all(k in planned for k in got):
        return dict(got)
    spelled: dict[tuple[type, str], list[Any]] = {}
    for k in planned:
        if k not in got:
            spelled.setdefault((type(k), repr(k)), []).append(k)
    return {
        k if k in planned or not (same := spelled.get((type(k), repr(k)))) else same.pop(0): v
        for k, v in got.items()
    }


def _without_unplanned_aliases(
    got: Mapping[Any, Any], planned: Mapping[Any, Any]
) -> dict[Any, Any]:
    """A safetensors output reads back with the tied names its metadata records, each the
    same tensor as its stored name (which comes first); a plan that lists only the stored
    names is checked against those."""
    first = {id(t): k for k, t in reversed(list(got.items()))}
    return {k: t for k, t in got.items() if k in planned or first[id(t)] == k}
