"""Comparing two state dicts: keys, shapes, dtypes and values, tensor by tensor.

Each side is a checkpoint path or URL, an in-memory state dict or an ``nn.Module``. File
sides are never loaded whole: each tensor is streamed from the file in pieces
(:mod:`ckpt_tools.loading.tensor_io`), compared against the other side's piece, and dropped, so
two large checkpoints diff in bounded memory. Key mismatches come with the rewrite that
best explains them (:mod:`ckpt_tools.structure.suggest`) and the command that applies it.

Keys, shapes and dtypes come from each file's structure; values are read only when they are
compared, which is by default unless a side is a URL (``values=True`` fetches the compared
tensors' bytes by ranges). A diff of two files without values runs without torch.

Convention: A is what you have, B is what it should match (a model or a reference), as in
``load_into``: *missing* keys are in B and not in A, *unexpected* keys are in A and not in B.
Every key counts, non-tensor entries included; against a module B they are the keys its strict
``load_state_dict`` would report (:mod:`ckpt_tools.diffing.key_verdict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from ckpt_tools._types import Select
from ckpt_tools.diffing.parts import SideInfo, Suggestion, TensorDiff
from ckpt_tools.diffing.report import FAIL_CATEGORIES, DiffReport
from ckpt_tools.diffing.sides import DiffSide, Side, is_file, kind_pair, open_side
from ckpt_tools.diffing.tolerances import check_tolerances
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import UsageError
from ckpt_tools.io.remote.urls import is_url
from ckpt_tools.loading.extras import require_torch
from ckpt_tools.structure.keys import plan_renames
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

__all__ = [
    "FAIL_CATEGORIES",
    "DiffReport",
    "SideInfo",
    "Suggestion",
    "TensorDiff",
    "check_tolerances",
    "compares_values",
    "diff",
]

#: Bytes :func:`diff` reads per side at a time; a chunk's temporaries are a few times this.
CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------
# Values


def _compare(
    name: str, a: Side, b: Side, rtol: float, atol: float, chunk_bytes: int, values: bool
) -> TensorDiff:
    """One common key: layout, dtype and shape first, then (if asked) values."""
    (dtype_a, shape_a), (dtype_b, shape_b) = a.meta(name), b.meta(name)
    layout_a, layout_b = a.layout(name), b.layout(name)
    base = TensorDiff(
        name,
        dtype_a,
        dtype_b,
        shape_a,
        shape_b,
        values_compared=values,
        layout_a=layout_a,
        layout_b=layout_b,
    )
    if layout_a != layout_b:
        return replace(base, note=f"layouts differ: {layout_a} / {layout_b}")
    if shape_a is None or shape_b is None:  # a lazy parameter: no values, any shape loads
        side = "A" if shape_a is None else "B"
        return replace(
            base,
            values_compared=False,
            note=f"uninitialized in {side} (a lazy module's): it takes the other side's shape "
            "when loaded; values not compared",
        )
    if layout_a == "meta":
        return _compare_meta(base, a.stride(name), b.stride(name))
    if not values or shape_a != shape_b:
        return base
    if layout_a != "strided":
        from ckpt_tools.diffing.rebuilt import compare_pieces

        return compare_pieces(base, a.pieces(name), b.pieces(name), rtol, atol)
    from ckpt_tools.diffing.quantized import QUANTIZED_DTYPES, compare_quantized
    from ckpt_tools.diffing.value_stats import ValueStats, with_stats

    elements = max(1, chunk_bytes // max(itemsize(dtype_a), itemsize(dtype_b)))
    if {dtype_a, dtype_b} & QUANTIZED_DTYPES:  # integers mean what their quantizer says
        return compare_quantized(base, a.tensor(name), b.tensor(name), rtol, atol, elements)
    stats = ValueStats(dtype_a, dtype_b, rtol, atol)
    for ca, cb in zip(a.chunks(name, elements), b.chunks(name, elements)):
        stats.add(ca, cb)
    return with_stats(base, stats)


def _compare_meta(
    base: TensorDiff, stride_a: tuple[int, ...], stride_b: tuple[int, ...]
) -> TensorDiff:
    """Two meta tensors: no values to read, so equal where dtype, shape and strides are."""
    same = base.dtype_a == base.dtype_b and base.shape_a == base.shape_b and stride_a == stride_b
    note = "" if stride_a == stride_b else f"strides differ: {stride_a} / {stride_b}"
    return replace(base, bit_equal=same, values_compared=True, note=note)


# ---------------------------------------------------------------------------------------
# Suggestions


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


def _apply_command(
    side: SideInfo, steps: Sequence[Step], select: Any, keys: Sequence[str], name: str
) -> str:
    """How to apply ``steps`` to one side: a ``ckpt`` command for a file, a Python call for a
    state dict (called ``name``), nothing for a module or a URL (rewrites read local files)."""
    if side.kind == "file" and is_url(side.label):
        return ""
    if side.kind == "file":
        return fix_command(side.label, steps, select, keys)
    if side.kind == "state_dict":
        return fix_python(steps, name)
    return ""


def _suggestions(
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
    scored = sorted(((fix, n) for fix, n in counted if n), key=lambda pair: -pair[1])
    # What load_into would do with the stored keys: a note where that is the suggestion.
    by_itself = best_fix(list(stored_all), list(b.keys)) if b.info.kind == "module" else None
    # A rewrite that resolves every unexpected key subsumes the partial ones: they are noise.
    complete = [(fix, n) for fix, n in scored if n == len(unexpected)]
    out = []
    for fix, count in (complete or scored)[:limit]:
        steps = on_stored(aligned, fix.steps)
        if aligned:
            whole = check_fix(steps, stored, keys_b)
            if whole is None or whole.matched < fix.matched:
                continue
        command = _apply_command(a.info, steps, select, stored, "sd_a")
        inverse_command = inverse_text = ""
        inverse = _inverse(steps, fix, keys_b, stored)
        if inverse is not None:
            inverse_text = ", then ".join(step.describe() for step in inverse)
            inverse_command = _apply_command(b.info, inverse, select_b, keys_b, "sd_b")
        note = ""
        if by_itself is not None and by_itself.steps == steps:
            note = "ckpt_tools.load_into(model, ...) applies this rewrite by itself"
        elif a.info.kind == "file" and is_url(a.info.label):
            note = "A is a URL: the ckpt rewrites read local files, so download it to apply this"
        out.append(
            Suggestion(
                description=fix.describe(),
                steps=fix.steps,
                resolved=count,
                of=len(unexpected),
                command=command,
                inverse_description=inverse_text,
                inverse_command=inverse_command,
                note=note,
            )
        )
    return tuple(out)


# ---------------------------------------------------------------------------------------
# diff


@contextlib.contextmanager
def _torch_threads(jobs: int) -> Iterator[None]:
    import torch

    if jobs == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(jobs)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def compares_values(a: object, b: object, values: bool | None) -> bool:
    """Whether :func:`diff` compares values: as ``values`` says, and by default (None) unless
    a side is a URL (its keys, shapes and dtypes come from its structure alone).

    Example:
        >>> compares_values("a.pt", "hf://org/model", None), compares_values("a.pt", "b.pt", None)
        (False, True)
    """
    if values is not None:
        return values
    return not (is_url(a) or is_url(b))


def diff(
    a: DiffSide,
    b: DiffSide,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    select: Select = None,
    select_b: Select = None,
    align: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    jobs: int = 1,
    values: bool | None = None,
) -> DiffReport:
    """Compare two state dicts key by key and tensor by tensor, in bounded memory.

    Args:
        a: what you have: a checkpoint path (any format :func:`ckpt_tools.open_checkpoint`
            reads; never unpickled with code, never loaded whole) or URL (``https://``,
            ``hf://ORG/REPO[@REV][/PATH]``, ``s3://BUCKET/KEY``: its structure is fetched by
            byte ranges), a state dict, or an ``nn.Module`` (its ``state_dict()``). A DTensor
            is compared through its local tensor where that is the whole tensor (a mesh of
            one rank, or only ``Replicate`` placements); elsewhere only its dtype and shape
            are, with ``values=False``.
        b: what it should match, in the same forms. Where it is a module, missing and
            unexpected keys are those its strict ``load_state_dict`` would report, its
            modules' loading code taken into account as :func:`ckpt_tools.load_into` does
            (old BatchNorm and ``weight_norm`` state dicts, ``_metadata`` versions); the keys
            that differ by name only are ``reconciled_missing`` / ``reconciled_unexpected``.
            A lazy module's uninitialized parameter takes any shape (status
            ``uninitialized``).
        rtol, atol: tolerances, as in ``torch.isclose``: finite real numbers >= 0.
        select: dotted path (or sequence of keys) to the state dict in checkpoint A, as
            everywhere else (default: chosen automatically, as ``ckpt inspect`` does).
        select_b: the same for B.
        align: first rewrite A's keys with the wrapper rewrite that best matches B's (as
            :func:`ckpt_tools.load_into` does: ``module.``, ``_orig_mod.``, ``model.`` ...),
            then compare; the report says which (``aligned``) and how to make it permanent
            (``aligned_command``); suggestions are only for the keys it left unmatched.
        chunk_bytes: bytes read per side at a time while comparing one tensor.
        jobs: torch intra-op threads while comparing, restored afterwards. The work is
            memory-bound: one thread is as fast on an idle machine and far faster on a busy
            one (spinning worker threads).
        values: compare values too. None (the default) compares them unless a side is a
            URL; True also reads a URL's compared tensors (only theirs, by ranges); False
            compares keys, shapes and dtypes only, which for two file sides needs no torch.
            The report's ``values_compared`` says which.

    Returns:
        A :class:`DiffReport`: missing and unexpected keys, one :class:`TensorDiff` per
        common key, and :class:`Suggestion` s for rewrites explaining key mismatches; where
        a URL was read, its ``transfer`` says what that cost.

    Raises:
        UsageError: a side is of an unsupported type, ``select`` or ``select_b`` is given
            for a module, a tolerance is not a real number, or is negative, NaN or
            infinite, ``jobs`` < 1, or values are compared of a DTensor spread over several
            ranks (seeing it whole takes a collective: pass a full state dict).
        SelectError: ``select`` or ``select_b`` names a missing entry.
        CheckpointError: a file is missing, truncated or malformed.
        RemoteError: a URL could not be read (refused credentials, a timeout, a refused
            connection, a server that ignores byte ranges).

    Example:
        >>> report = diff("ddp.pt", "model.pt")  # the same weights, saved from DataParallel
        >>> sorted(report.found())
        ['missing', 'unexpected']
        >>> report.suggestions[0].text()
        "stripping 'module.' resolves 17 of 17 unexpected keys: ckpt strip-module ddp.pt ..."
        >>> diff("ddp.pt", "model.pt", align=True).identical
        True
        >>> diff("model.pt", "model.pt", values=False).tensor("conv.weight").status
        'unchecked'
    """
    rtol, atol = check_tolerances(rtol, atol)  # before torch or a file is touched
    compare = compares_values(a, b, values)
    if compare or not (is_file(a) and is_file(b)):
        require_torch("diff")
    if jobs < 1:
        raise UsageError("must be at least 1", argument="jobs", value=repr(jobs))
    with contextlib.ExitStack() as stack:
        session = None
        if is_url(a) or is_url(b):
            from ckpt_tools.io.remote import RemoteSession

            session = stack.enter_context(RemoteSession())
        if compare:
            stack.enter_context(_torch_threads(jobs))
        side_a = open_side(a, select, "A", compare, session, stack)
        side_b = open_side(b, select_b, "B", compare, session, stack)
        report = _report(side_a, side_b, rtol, atol, select, select_b, align, chunk_bytes, compare)
        return replace(report, transfer=session.stats) if session is not None else report


def _report(
    side_a: Side,
    side_b: Side,
    rtol: float,
    atol: float,
    select: Select,
    select_b: Select,
    align: bool,
    chunk_bytes: int,
    values: bool,
) -> DiffReport:
    """Keys matched (after the alignment, if asked), tensors compared, suggestions made.

    Every key counts, non-tensor entries included; against a module (B), missing and
    unexpected keys are those torch's strict ``load_state_dict`` would report
    (:mod:`ckpt_tools.diffing.key_verdict`)."""
    from ckpt_tools.diffing.key_verdict import by_name, by_torch

    stored = list(side_a.keys)
    stored_tensors = [k for k in stored if side_a.holds_tensor(k)]
    fix = best_fix(stored, list(side_b.keys)) if align else None
    aligned = fix.steps if fix is not None else ()
    if fix is not None:
        side_a.rename(plan_renames(stored, fix.rules), fix.rules)
    torch_judges = side_b.module is not None
    keys = by_torch(side_a, side_b) if torch_judges else by_name(side_a, side_b)
    judged = torch_judges and not keys.fallback
    # Suggested after the alignment: never the rewrite --align has just applied.
    suggestions = (
        _suggestions(
            side_a,
            side_b,
            select,
            select_b,
            keys.unexpected,
            judged,
            aligned,
            (stored, stored_tensors),
        )
        if keys.unexpected
        else ()
    )
    a, b, in_b = side_a, side_b, set(side_b.keys)
    # A's tensors in its order, then its other keys that are a tensor in B (or not read).
    later = (k for k in a.keys if k not in a.entries and (a.holds_tensor(k) or b.holds_tensor(k)))
    tensors = tuple(
        _compare(name, a, b, rtol, atol, chunk_bytes, values)
        if name in a.entries and name in b.entries
        else kind_pair(name, a, b, values)
        for name in (*a.entries, *later)
        if name in in_b
    )
    return DiffReport(
        a=side_a.info,
        b=side_b.info,
        rtol=rtol,
        atol=atol,
        missing=keys.missing,
        unexpected=keys.unexpected,
        tensors=tensors,
        suggestions=suggestions,
        aligned=tuple(step.describe() for step in aligned),
        aligned_command=(
            _apply_command(side_a.info, aligned, select, stored_tensors, "sd_a") if aligned else ""
        ),
        values_compared=values,
        reconciled_missing=keys.reconciled_missing,
        reconciled_unexpected=keys.reconciled_unexpected,
        keys_by_name=keys.fallback,
    )
