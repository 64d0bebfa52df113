"""Comparing two state dicts: keys, shapes, dtypes and values, tensor by tensor.

Each side is a checkpoint path or URL, an in-memory state dict or an ``nn.Module``. File
sides are never loaded whole: each tensor is streamed from the file in pieces
(:mod:`ckpt_tools.loading.tensor_io`), compared against the other side's piece, and dropped, so
two large checkpoints diff in bounded memory (a strided view, such as a transpose, is read as
the span of its storage it covers: memory bounded by the largest such tensor). Key mismatches
come with the rewrite that best explains them (:mod:`ckpt_tools.structure.suggest`) and the
command that applies it.

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
import math
from collections.abc import Iterator
from dataclasses import replace

from ckpt_tools._types import Select, checked_flags, count_of
from ckpt_tools.diffing.parts import SideInfo, Suggestion, TensorDiff, is_file
from ckpt_tools.diffing.report import FAIL_CATEGORIES, DiffReport
from ckpt_tools.diffing.sides import DiffSide, Side, open_side
from ckpt_tools.diffing.suggestions import apply_command, suggested_rewrites
from ckpt_tools.diffing.tolerances import check_tolerances
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import KeyCollisionError, shown
from ckpt_tools.io.remote.urls import is_url
from ckpt_tools.loading.extras import require_torch
from ckpt_tools.structure.keys import plan_renames
from ckpt_tools.structure.suggest import (
    best_fix,
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
    # torch's load takes a one-element vector for a module's 0-dim tensor (its first element).
    squeezed = b.module is not None and shape_a == (1,) and shape_b == ()
    base = TensorDiff(
        name,
        dtype_a,
        dtype_b,
        shape_a,
        shape_b,
        values_compared=values,
        layout_a=layout_a,
        layout_b=layout_b,
        squeezed=squeezed,
        note="torch loads A's one element into B's 0-dim tensor" if squeezed else "",
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
    if not values or (shape_a != shape_b and not squeezed):
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
    # A dim both sides repeat (stride 0: expanded) is compared once and counted as often as
    # it repeats: an 827-byte file may stand for 2**62 elements.
    pairs = zip(a.stride(name), b.stride(name), shape_a)
    once = [d for d, (x, y, n) in enumerate(pairs) if x == y == 0 and n > 1] * (shape_a == shape_b)
    for ca, cb in zip(a.chunks(name, elements, once), b.chunks(name, elements, once)):
        stats.add(ca, cb)
    stats.repeat(math.prod(shape_a[d] for d in once))
    return with_stats(base, stats)


def _refuse_retyped(a: Side, b: Side) -> None:
    """Refuse a name that is a str key on one side and another key on the other (``"7"``
    and ``7``): entries are paired by name, and the pair would pass for one key."""
    both = set(a.keys) & set(b.keys)
    retyped = sorted(n for n in both if (n in a.not_str) != (n in b.not_str))
    if retyped:
        name = retyped[0]
        raise KeyCollisionError(
            f"{shown(name)!r} is a str key in one side and a key of another type in the other "
            "(7 and '7'): a diff pairs entries by name, and would take them for one key",
            tuple((n, ("A", "B")) for n in retyped),
        )


def _compare_meta(
    base: TensorDiff, stride_a: tuple[int, ...], stride_b: tuple[int, ...]
) -> TensorDiff:
    """Two meta tensors: no values to read, so equal where dtype, shape and strides are."""
    same = base.dtype_a == base.dtype_b and base.shape_a == base.shape_b and stride_a == stride_b
    note = "" if stride_a == stride_b else f"strides differ: {stride_a} / {stride_b}"
    return replace(base, bit_equal=same, values_compared=True, note=note)


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


@checked_flags
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
    count_of(jobs, "jobs", flag="--jobs")
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

    _refuse_retyped(side_a, side_b)
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
        suggested_rewrites(
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
        else _kind_pair(name, a, b, values)
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
            apply_command(side_a.info, aligned, select, stored_tensors, "sd_a") if aligned else ""
        ),
        values_compared=values,
        reconciled_missing=keys.reconciled_missing,
        reconciled_unexpected=keys.reconciled_unexpected,
        keys_by_name=keys.fallback,
    )


def _kind_pair(name: str, a: Side, b: Side, values: bool) -> TensorDiff:
    """A key that is a tensor on one side and another kind of entry on the other, or a
    tensor of a subclass that is not read (:class:`~ckpt_tools.diffing.entries.Foreign`)
    on either: present on both sides, not comparable (status ``kind``). A non-tensor entry's
    kind stands for its dtype.

    Example:
        >>> import torch
        >>> from ckpt_tools.diffing.report import SideInfo
        >>> a = Side(SideInfo("<state dict>", "state_dict"), {"y": torch.ones(2)}, None)
        >>> b = Side(SideInfo("<state dict>", "state_dict"), {}, None, {"y": "str"})
        >>> pair = _kind_pair("y", a, b, True)
        >>> pair.status, pair.dtype_b, pair.note
        ('kind', 'str', 'a tensor in A, a str in B: not compared')
    """
    described = []
    for side in (a, b):
        kind = side.kind(name)
        if side.holds_tensor(name):
            dtype, shape = side.meta(name)
            described.append((kind, dtype, shape, side.layout(name)))
        else:
            described.append((kind, kind, (), ""))
    (kind_a, dtype_a, shape_a, layout_a), (kind_b, dtype_b, shape_b, layout_b) = described
    unread = "a tensor subclass diff does not read"
    if name in a.foreign and name in b.foreign and kind_a == kind_b:
        note = f"{_article(kind_a)} on both sides, {unread}: not compared"
    else:
        what_a, what_b = (
            _article(side.kind(name)) + f" ({unread})" * (name in side.foreign) for side in (a, b)
        )
        note = f"{what_a} in A, {what_b} in B: not compared"
    return TensorDiff(
        name,
        dtype_a,
        dtype_b,
        shape_a,
        shape_b,
        values_compared=values,
        layout_a=layout_a,
        layout_b=layout_b,
        kind_a=kind_a,
        kind_b=kind_b,
        note=note,
    )


def _article(kind: str) -> str:
    """``kind`` after its indefinite article: "a str", "an int"."""
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"
