"""Which keys differ, and how many of them a suggested rewrite resolves.

Every key counts, the entries that are not tensors included (``_extra_state``, ``epoch``): a
key on one side only is missing or unexpected whatever it holds. Between state dicts, keys are
compared by name (:func:`by_name`). Against a module (side B), names alone are not the
verdict: its modules' loading code reconciles some differences (BatchNorm fills
``num_batches_tracked`` in a state dict older than its version 2,
``parametrizations.weight_norm`` takes the old ``weight_g``/``weight_v``). So A's state dict is
handed to :func:`ckpt_tools.loading.rehearsal.rehearse`, as ``load_into`` hands it
(:func:`by_torch`): its tensors as meta tensors of their dtypes and shapes (nothing is read),
its other entries as they are, its ``_metadata`` (the module versions) kept, its keys as an
alignment renamed them. torch's missing and unexpected keys are the report's; the keys that
differ by name and that torch takes all the same are reconciled (reported, not compared).

A suggested rewrite resolves the unexpected keys it renames onto a key of B holding the same
kind of entry (a tensor of the same shape), or, against a module, those that torch no longer
calls unexpected, nor refuses for their shape, once the rewrite is applied
(:func:`resolved`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_tools.diffing.sides import Side
from ckpt_tools.errors import KeyCollisionError
from ckpt_tools.structure.keys import apply_plan, plan_renames
from ckpt_tools.structure.steps import Step, step_rules

if TYPE_CHECKING:
    import torch

__all__ = ["KeyVerdict", "by_name", "by_torch", "resolved", "shapes"]


@dataclass(frozen=True)
class KeyVerdict:
    """Which keys differ, and which differ by name only.

    Attributes:
        missing: keys of B absent from A (torch's ``missing_keys`` against a module).
        unexpected: keys of A absent from B (torch's ``unexpected_keys`` against a module).
        reconciled_missing: keys of B without a namesake in A that torch does not call
            missing (a module's loading code fills or renames them).
        reconciled_unexpected: keys of A without a namesake in B that torch takes.
        fallback: why torch's verdict could not be taken (the keys were compared by name).
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    reconciled_missing: tuple[str, ...] = ()
    reconciled_unexpected: tuple[str, ...] = ()
    fallback: str = ""


def by_name(a: Side, b: Side) -> KeyVerdict:
    """Every key of each side (non-tensor entries included) against the other's, by name."""
    keys_a, keys_b = set(a.keys), set(b.keys)
    return KeyVerdict(
        missing=tuple(k for k in b.keys if k not in keys_a),
        unexpected=tuple(k for k in a.keys if k not in keys_b),
    )


def by_torch(a: Side, b: Side) -> KeyVerdict:
    """The keys as ``b.module.load_state_dict(A's state dict, strict=True)`` judges them.

    Args:
        a: the state dict's side, its keys as compared (after any alignment).
        b: a module's side.

    Returns:
        torch's missing and unexpected keys, and what names alone would add to them; where
        torch's verdict could not be taken, the names' and why (``fallback``).
    """
    from ckpt_tools.loading.rehearsal import rehearse

    named = by_name(a, b)
    assert b.module is not None
    try:
        verdict = rehearse(b.module, stand_ins(a))
    except Exception as e:  # the names still say something; the report says why they do
        return KeyVerdict(named.missing, named.unexpected, fallback=f"rehearsal failed: {e!r}")
    return KeyVerdict(
        missing=verdict.missing,
        unexpected=verdict.unexpected,
        reconciled_missing=tuple(k for k in named.missing if k not in verdict.missing),
        reconciled_unexpected=tuple(k for k in named.unexpected if k not in verdict.unexpected),
        fallback=verdict.fallback or "",
    )


class _AnyShape:
    """A lazy parameter's shape: equal to any (it takes the shape it is loaded with)."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]


def shapes(side: Side) -> dict[str, Any]:
    """Each tensor's shape by key (an uninitialized one's equal to any); no other entry's."""
    out: dict[str, Any] = {}
    for key in side.keys:
        if side.holds_tensor(key):
            shape = side.meta(key)[1]
            out[key] = _AnyShape() if shape is None else shape
    return out


def resolved(
    a: Side, b: Side, steps: Sequence[Step], unexpected: Sequence[str], torch_judges: bool
) -> tuple[int, tuple[str, ...]] | None:
    """How many of the ``unexpected`` keys of A ``steps`` resolve, and the keys of B still
    missing once they are applied (a module's loading code may reconcile a key before the
    rewrite and not after: its ``_metadata`` moves with the keys); None where the steps
    cannot apply to every key of A (two keys would become one, a key that matched is renamed).

    Args:
        a, b: the sides, A's keys as compared (after any alignment).
        steps: the rewrite of A's keys.
        unexpected: the keys of A the report calls unexpected.
        torch_judges: B is a module whose strict load decided ``unexpected``: the rewrite's
            keys are rehearsed too.
    """
    rules = step_rules(steps)
    try:
        plan = plan_renames(a.keys, rules)
    except KeyCollisionError:
        return None
    in_b = set(b.keys)
    if any(plan[k] != k for k in a.keys if k in in_b):
        return None
    if not torch_judges:
        shapes_a, shapes_b = shapes(a), shapes(b)
        renamed = set(plan.values())
        count = sum(
            1 for k in unexpected if plan[k] in in_b and shapes_a.get(k) == shapes_b.get(plan[k])
        )
        return count, tuple(k for k in b.keys if k not in renamed)
    from ckpt_tools.loading.rehearsal import rehearse

    assert b.module is not None
    verdict = rehearse(b.module, apply_plan(stand_ins(a), plan, rules))
    refused = {*verdict.unexpected, *(m.key for m in verdict.shape_mismatches)}
    return sum(1 for key in unexpected if plan[key] not in refused), tuple(verdict.missing)


def stand_ins(side: Side) -> OrderedDict[str, Any]:
    """The side's state dict as the rehearsal takes it: meta tensors of each tensor's dtype and
    shape, every other entry as it is, in its order, with its ``_metadata``."""
    import torch

    out: OrderedDict[str, Any] = OrderedDict()
    for key in side.keys:
        if side.holds_tensor(key):
            dtype, shape = side.meta(key)
            out[key] = _meta_tensor(torch, dtype, shape)
        else:
            out[key] = side.values.get(key)
    if side.metadata is not None:
        out._metadata = side.metadata  # type: ignore[attr-defined]  # copied by rehearse
    return out


def _meta_tensor(torch: Any, dtype: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    """A meta tensor standing for one of ``dtype`` and ``shape``: a nested tensor's unknown
    sizes (-1) are 0, an uninitialized one is empty, a dtype torch lacks is float32."""
    from ckpt_tools.errors import UnsupportedFormatError
    from ckpt_tools.loading.tensor_io import torch_dtype

    try:
        as_dtype = torch_dtype(dtype)
    except UnsupportedFormatError:
        as_dtype = torch.float32
    sizes = (0,) if shape is None else tuple(max(n, 0) for n in shape)
    return torch.empty(sizes, dtype=as_dtype, device="meta")
