"""Loading into models whatever their wrappers: :func:`load_into`.

It reconciles wrapper prefixes (``module.``, ``_orig_mod.``, ``model.`` ...) between the
checkpoint and the model with the rules of :mod:`ckpt_tools.structure.keys`, asks torch what it
would make of the result (:mod:`ckpt_tools.loading.rehearsal`: the modules' own loading code
included, the model untouched), loads, and reports what it did, including the shape mismatches
``strict=False`` skipped.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal

from ckpt_tools._escape import shell_path, short_repr, shown
from ckpt_tools._types import MapLocation, Select, StrPath, checked_flags
from ckpt_tools.errors import CheckpointError, Remedy, StateDictMismatchError, UsageError
from ckpt_tools.formats.log import logger
from ckpt_tools.loading.extras import require_torch
from ckpt_tools.loading.kept_values import unmapped_where_kept
from ckpt_tools.loading.rehearsal import Verdict, rehearse, skipping, with_own_metadata
from ckpt_tools.loading.results import LoadReport, ShapeMismatch
from ckpt_tools.loading.state_dict import LoadInfo, _selection_checked, load_state
from ckpt_tools.structure.grouping import fold_keys
from ckpt_tools.structure.keys import rename_keys
from ckpt_tools.structure.paths import select_text
from ckpt_tools.structure.selection import is_state_dict
from ckpt_tools.structure.suggest import (
    KeyFix,
    best_fix,
    fix_command,
    fix_python,
    rank_fixes,
    wrapper_stack,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LoadReport", "ShapeMismatch", "load_into", "on_meta"]


def _mismatch_message(
    report: LoadReport,
    select: Select,
    source_keys: Sequence[str],
    model_keys: Sequence[str],
    applied: KeyFix | None,
    verdict: Verdict,
) -> str:
    parts = [f"{report.source} does not match {report.model_class}"]
    if report.rewrites:
        parts.append(f"(after {', '.join(report.rewrites)})")
    lines = [" ".join(parts) + ":"]
    if report.missing:
        lines.append(
            f"  {len(report.missing)} missing (in the model, not in the checkpoint): "
            + fold_keys(report.missing)
        )
    if report.unexpected:
        lines.append(
            f"  {len(report.unexpected)} unexpected (in the checkpoint, not in the model): "
            + fold_keys(report.unexpected)
        )
    if report.shape_mismatches:
        listed = ", ".join(str(m) for m in report.shape_mismatches[:4])
        more = " ..." if len(report.shape_mismatches) > 4 else ""
        lines.append(f"  {len(report.shape_mismatches)} shape mismatch(es): {listed}{more}")
    lines += [f"  torch: {error}" for error in verdict.errors]
    if verdict.fallback is not None:
        lines.append(
            f"  (keys compared by name, without the modules' own loading code: {verdict.fallback}; "
            "torch's load_state_dict may still accept them)"
        )
    # A rewrite of the keys as stored (the command acts on the file) that does better than
    # the wrapper rewrite applied here.
    fixes = rank_fixes(source_keys, model_keys) if report.unexpected else ()
    done = (
        applied.matched if applied is not None else sum(k in set(model_keys) for k in source_keys)
    )
    if fixes and fixes[0].matched > done:
        fix = fixes[0]
        how = (
            fix_command(report.source, fix.steps, select, **_rewrite_needs(report.source, select))
            if report.info is not None
            else fix_python(fix.steps)
        )
        lines.append(
            f"  {fix.describe()} resolves {fix.resolved} of {fix.unmatched} unexpected keys: {how}"
        )
    if report.info is None:  # a state dict in memory: the call that compares it
        diff = "`ckpt_tools.diff(state_dict, model)` to see every difference."
    else:
        chosen = "" if select is None else f" --select {shell_path(select_text(select))}"
        diff = (
            f"`ckpt diff {shell_path(report.source)}{chosen} --model MODULE:FACTORY` to see "
            "every difference."
        )
    if verdict.errors:  # strict=False skips keys and shapes; torch's other errors stand
        lines.append(f"Run {diff}")
    else:
        lines.append(
            "Pass strict=False to load the keys that match and get the rest in the report, or "
            f"run {diff}"
        )
    return "\n".join(map(shown, lines))  # (a key cannot start a line of its own)


def _rewrite_needs(path: str, select: Select) -> dict[str, Any]:
    """What a rewrite of the file at ``path`` must be told (its globals outside the allowlist;
    a pickled module's state dict goes to safetensors), as :func:`fix_command` takes it."""
    from ckpt_tools.formats import open_checkpoint
    from ckpt_tools.structure.selection import select_state_dict

    try:
        ckpt = open_checkpoint(path)
        recovered = select_state_dict(ckpt.root, select=select).module is not None
    except CheckpointError:  # (read once already: the message is made with what is known)
        return {}
    return {"allow_globals": ckpt.unsafe_globals, "recovered": recovered, "fmt": ckpt.format}


def _source_state_dict(
    source: StrPath | Mapping[str, Any],
    map_location: MapLocation,
    select: Select,
    trust: bool,
    mmap: bool | Literal["staged"],
) -> tuple[Mapping[str, Any], str, LoadInfo | None]:
    source = _live_modules_as_state_dicts(source)
    if isinstance(source, Mapping):
        if select is not None or not is_state_dict(source):
            chosen = _selection_checked(source, select, "<state dict>", trusted=False)
            assert chosen is not None  # (only a trusted file leaves the choice to torch)
            source = chosen.state_dict
        return source, "<state dict>", None
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(
            f"expected a checkpoint path, a state dict or a module, got {type(source).__name__}",
            argument="src",
            value=short_repr(source, 60),
        )
    # Copied, the model's tensors are where the data ends up: stage on the CPU and copy once,
    # rather than holding a second copy on the GPU. Assigned, they are the loaded ones.
    auto = isinstance(map_location, str) and map_location == "auto"
    location = "cpu" if auto and mmap == "staged" else map_location
    sd, info = load_state(source, location, select, trust, mmap, "load_into")
    if location is not map_location:
        info = replace(info, map_location="auto (staged on cpu)")
    return sd, info.path, info


def _live_modules_as_state_dicts(source: Any, depth: int = 0) -> Any:
    """``source`` with every live ``nn.Module`` in it (``torch.load(weights_only=False)`` of
    ``{"model": module}``) as its ``state_dict()``, as a file's pickled module is recovered;
    dicts along the way are copied, nothing else is."""
    from torch import nn

    if isinstance(source, nn.Module):
        return source.state_dict()
    if depth > 4 or not isinstance(source, Mapping):
        return source
    held = {k: _live_modules_as_state_dicts(v, depth + 1) for k, v in source.items()}
    changed = any(held[k] is not v for k, v in source.items())
    return held if changed else source


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (no storage).

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(4, 2)
        >>> on_meta(net), on_meta(torch.nn.Linear(4, 2))
        (True, False)
    """
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.device.type == "meta" for t in tensors)


@checked_flags
def load_into(
    model: nn.Module,
    src: StrPath | Mapping[str, Any],
    *,
    strict: bool = True,
    map_location: MapLocation = "auto",
    select: Select = None,
    trust: bool = False,
    assign: bool | None = None,
    mmap: bool = False,
) -> LoadReport:
    """Load a checkpoint into a model, reconciling wrapper prefixes on both sides.

    The wrapper stacks of the model's keys (plain, ``nn.DataParallel``/DDP ``module.``,
    ``torch.compile``'s ``_orig_mod.``, a Lightning-style ``model.`` attribute ...) and of
    the checkpoint's keys are compared (:func:`ckpt_tools.structure.suggest.best_fix`), and the
    checkpoint's keys are rewritten with :mod:`ckpt_tools.structure.keys` rules to match.

    Missing and unexpected keys and shape mismatches are torch's own verdict, with each
    module's loading code taken into account (BatchNorm state dicts from before
    ``num_batches_tracked``, ``weight_norm``'s old ``weight_g``/``weight_v``, load-state-dict
    pre-hooks, ``_load_from_state_dict`` overrides, the module versions in ``_metadata``): it is
    found by :func:`ckpt_tools.loading.rehearsal.rehearse` on a meta copy of the model before
    anything is loaded. Where that cannot run (a model that does not deep-copy, a hook that
    needs real values), the keys are compared by name, and a warning is logged.

    Args:
        model: the target module (wrapped or not).
        src: a checkpoint path, or an in-memory state dict (or a dict holding one; a
            module in it, as ``torch.load(weights_only=False)`` gives it, stands for its
            ``state_dict()``).
        strict: with True, any missing or unexpected key or shape mismatch raises and the
            model is left untouched; with False, matching keys load and the rest is reported
            (shape mismatches are skipped, where ``nn.Module.load_state_dict`` would raise).
            Either way, a state dict torch would refuse for another reason (a value that is
            not a tensor) raises before anything is loaded.
        map_location: as for :func:`load_state_dict`; ``"auto"`` here stages storages on
            the CPU where they are copied into the model's tensors (with ``assign`` they
            are the model's, and stay where they were saved).
        select: dotted path to the state dict inside the checkpoint.
        trust: see :func:`load_state_dict`.
        assign: make the loaded tensors the model's own
            (``model.load_state_dict(..., assign=True)``) instead of copying into them.
            Default (None): True exactly when the model has parameters or buffers on the
            ``meta`` device, so a model built under ``torch.device("meta")`` is loaded
            without a second copy of its weights. With ``assign``, the checkpoint's dtypes
            and devices are kept (nothing is cast).
        mmap: with ``assign``, make the model's tensors views of the memory-mapped file
            (as :func:`load_state_dict`'s ``mmap``: nothing allocated, nothing copied, so
            a model larger than half the RAM loads; the file must then not change while
            the model lives). Without ``assign`` the values are copied into the model's
            own tensors, and the file is mapped as a staging area whatever this says (read
            where a storage record is compressed, which cannot be mapped).

    Returns:
        A :class:`LoadReport`.

    Raises:
        StateDictMismatchError: ``strict=True`` and the keys or shapes differ, or torch would
            refuse the state dict for another reason; the message lists them (repeated layers
            folded) and says how to proceed.
        UsageError, UnsafeContentError, CheckpointError: see :func:`load_state_dict`.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(4, 2)
        >>> torch.save({f"module.{k}": v for k, v in net.state_dict().items()}, "dp.pt")  # DDP keys
        >>> report = load_into(torch.nn.Linear(4, 2), "dp.pt")
        >>> report.rewrites
        ("stripping 'module.'",)
    """
    require_torch("load_into")
    assign = on_meta(model) if assign is None else assign
    # Copied into the model's own tensors, the file's pages are only read once: mapping
    # them saves a copy. Assigned, they would become the model's: only when asked.
    staging = mmap if assign else "staged"
    sd, label, info = _source_state_dict(src, map_location, select, trust, staging)
    model_keys = list(model.state_dict())
    source_keys = [str(k) for k in sd]
    fix = best_fix(source_keys, model_keys)
    if fix is not None:
        sd = rename_keys(sd, fix.rules)
        logger.info("%s: %s to match %s", label, fix.describe(), type(model).__name__)
    if not assign and on_meta(model):  # (a model's state_dict() can gather: only then)
        _refuse_copies_into_meta(model, sd, label)
    verdict = rehearse(model, sd, assign=assign)
    report = LoadReport(
        source=label,
        model_class=type(model).__name__,
        model_layout=tuple(m.prefix for m in wrapper_stack(model_keys)),
        checkpoint_layout=tuple(m.prefix for m in wrapper_stack(source_keys)),
        rewrites=tuple(step.describe() for step in fix.steps) if fix else (),
        loaded=0,
        missing=verdict.missing,
        unexpected=verdict.unexpected,
        shape_mismatches=verdict.shape_mismatches,
        dtype_casts=() if assign else verdict.dtype_casts,
        info=info,
        assigned=assign,
    )
    # Errors other than keys and shapes make torch raise whatever strict says.
    if verdict.errors or (strict and not report.ok):
        raise StateDictMismatchError(
            _mismatch_message(report, select, source_keys, model_keys, fix, verdict)
        )
    return _load(model, sd, report, len(model_keys), strict=strict)


def _refuse_copies_into_meta(model: nn.Module, sd: Mapping[str, Any], label: str) -> None:
    """A copy into a meta tensor does nothing (torch only warns, and the weights stay
    unmade): refused, before anything is loaded, where the state dict has the values."""
    import torch

    meta = [
        k
        for k, t in model.state_dict().items()
        if isinstance(t, torch.Tensor)  # a module's extra state may be anything
        and t.is_meta
        and isinstance(sd.get(k), torch.Tensor)
        and not sd[k].is_meta
    ]
    if meta:
        raise UsageError(
            f"{len(meta)} of the model's tensors that {label}'s values would be copied into "
            f"are on the meta device, which holds no values ({fold_keys(meta)})",
            argument="assign",
            value="False",
            remedies=(Remedy("assign", "True", text="to take the checkpoint's tensors"),),
        )


def _load(
    model: nn.Module,
    sd: Mapping[str, Any],
    report: LoadReport,
    expected: int,
    *,
    strict: bool,
) -> LoadReport:
    """``model.load_state_dict`` less the shape mismatches; ``report`` completed."""
    skip = frozenset(m.key for m in report.shape_mismatches)
    # Copied, the file is only mapped while it is read: nothing a module keeps may view it.
    handed = sd if report.assigned else unmapped_where_kept(model, sd)
    own = with_own_metadata(OrderedDict(handed), sd)
    try:
        with skipping(model, skip):
            result = model.load_state_dict(own, strict=strict, assign=report.assigned)
    except RuntimeError as e:
        # Only a hook that acts on real values (or one the rehearsal could not run) gets here.
        raise StateDictMismatchError(
            f"{report.source}: {type(model).__name__}.load_state_dict refused the state dict "
            f"while loading, so some of the model's tensors may already be loaded: {e}"
        ) from e
    # torch's assign leaves what no state dict holds on meta, and says nothing.
    named = (*model.named_parameters(), *model.named_buffers()) if report.assigned else ()
    return replace(
        report,
        left_on_meta=(meta := tuple(name for name, t in named if t.is_meta)),
        meta_values=tuple(name for name in meta if name in sd),
        loaded=max(0, expected - len(result.missing_keys)),
        missing=tuple(k for k in result.missing_keys if k not in skip),
        unexpected=tuple(result.unexpected_keys),
    )
