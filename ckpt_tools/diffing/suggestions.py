"""The rewrites a diff suggests for key mismatches, and the command that applies each.

Found and ranked by :mod:`ckpt_tools.structure.suggest`; each counted by the unexpected keys it
resolves (:func:`~ckpt_tools.diffing.key_verdict.resolved`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpt_tools.diffing.parts import SideInfo, Suggestion
from ckpt_tools.diffing.sides import Side
from ckpt_tools.io.remote.urls import is_url
from ckpt_tools.structure.steps import on_stored
from ckpt_tools.structure.suggest import (
    KeyFix,
    Step,
    best_fix,
    check_fix,
    fix_command,
    fix_python,
    rank_fixes,
)

__all__ = ["apply_command", "suggested_rewrites"]

# Formats load_into refuses: its note that it applies a rewrite by itself does not hold.
_NOT_LOADED = ("dcp", "torchscript")


def _inverse(
    steps: Sequence[Step], fix: KeyFix, keys_b: Sequence[str], stored_a: Sequence[str]
) -> tuple[Step, ...] | None:
    """The same change made to B's keys instead, where it matches as many keys of A as
    stored as ``fix`` does, and renames none that matched (checked as ``fix`` was)."""
    if any(s.action == "strip-inner" for s in steps):
        return None
    inverse = tuple(s.inverse for s in reversed(steps))
    checked = check_fix(inverse, keys_b, stored_a)
    return inverse if checked is not None and checked.matched >= fix.matched else None


def apply_command(
    side: SideInfo, steps: Sequence[Step], select: Any, keys: Sequence[str], name: str
) -> str:
    """How to apply ``steps`` to one side: a ``ckpt`` command for a file, a Python call for a
    state dict (called ``name``), nothing for a module or a URL (rewrites read local files)."""
    if side.kind == "file" and is_url(side.label):
        return ""
    if side.kind == "file":
        needs = {"allow_globals": side.unsafe_globals, "recovered": side.recovered}
        return fix_command(side.label, steps, select, keys, **needs, fmt=side.format or "")
    if side.kind == "state_dict":
        return fix_python(steps, name)
    return ""


def suggested_rewrites(
    a: Side,
    b: Side,
    select: Any,
    select_b: Any,
    unexpected: Sequence[str],
    torch_judges: bool,
    aligned: tuple[Step, ...] = (),
    stored_a: tuple[Sequence[str], Sequence[str]] | None = None,
    limit: int = 3,
) -> tuple[Suggestion, ...]:
    """Rewrites of A's keys (after ``aligned``, if any) that make more of them match B's;
    where one makes all of them match, only those that do.

    Rewrites are found and ranked by the tensors' keys, each checked to send a key to the
    same tensor with its wrappers moved; each then resolves some of the ``unexpected`` keys,
    non-tensor entries included (:func:`~ckpt_tools.diffing.key_verdict.resolved`: against a
    module B, ``torch_judges``, those torch's strict load would then take).

    The commands apply ``aligned`` and then the suggested steps, since they run on the files
    as stored (``stored_a``: A's keys before the alignment, all and the tensors'); the
    description names only the suggested steps. A rewrite whose command would not do on the
    stored keys what the steps do after the alignment is left out.
    """
    from ckpt_tools.diffing.key_verdict import resolved, shapes

    # A key that is a tensor in A and another entry in B is a kind pair, not unexpected.
    keys_a = [k for k in a.keys if a.holds_tensor(k) and k not in b.others]
    keys_b = [k for k in b.keys if b.holds_tensor(k)]
    stored_all, stored = (a.keys, keys_a) if stored_a is None else stored_a
    fixes = rank_fixes(keys_a, keys_b, shapes=(shapes(a), shapes(b)))
    # Against a module each is rehearsed (a meta copy of it): only the best few by the keys.
    few = fixes[: 2 * limit] if torch_judges else fixes[: 3 * limit]
    counted = [(fix, resolved(a, b, fix.steps, unexpected, torch_judges)) for fix in few]
    scored = sorted(((fix, r) for fix, r in counted if r and r[0]), key=lambda pair: -pair[1][0])
    # What load_into would do with the stored keys: a note where that is the suggestion.
    by_itself = best_fix(list(stored_all), list(b.keys)) if b.info.kind == "module" else None
    # A rewrite that resolves every unexpected key subsumes the partial ones: they are noise.
    complete = [(fix, r) for fix, r in scored if r[0] == len(unexpected)]
    out = []
    for fix, (count, still_missing) in (complete or scored)[:limit]:
        steps = on_stored(aligned, fix.steps)
        if aligned:
            whole = check_fix(steps, stored, keys_b)
            if whole is None or whole.matched < fix.matched:
                continue
        command = apply_command(a.info, steps, select, stored, "sd_a")
        inverse_command = inverse_text = ""
        inverse = _inverse(steps, fix, keys_b, stored)
        if inverse is not None:
            inverse_text = ", then ".join(step.describe() for step in inverse)
            inverse_command = apply_command(b.info, inverse, select_b, keys_b, "sd_b")
        note = ""
        if by_itself is not None and by_itself.steps == steps and a.info.format not in _NOT_LOADED:
            note = "ckpt_tools.load_into(model, ...) applies this rewrite by itself"
        elif a.info.kind == "file" and is_url(a.info.label):
            note = "A is a URL: the ckpt rewrites read local files, so download it to apply this"
        out.append(
            Suggestion(
                description=fix.describe(),
                steps=fix.steps,
                resolved=count,
                of=len(unexpected),
                missing=still_missing,
                command=command,
                inverse_description=inverse_text,
                inverse_command=inverse_command,
                note=note,
            )
        )
    return tuple(out)
