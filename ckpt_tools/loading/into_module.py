"""Loading into models whatever their wrappers: :func:`load_into`.

It reconciles wrapper prefixes (``module.``, ``_orig_mod.``, ``model.`` ...) between the
checkpoint and the model with the rules of :mod:`ckpt_tools.structure.keys`, loads, and reports what
it did, including the shape mismatches ``strict=False`` skipped.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckpt_tools._types import MapLocation, Select, StrPath
from ckpt_tools.errors import StateDictMismatchError, UsageError
from ckpt_tools.loading.extras import require_torch
from ckpt_tools.loading.results import LoadReport, ShapeMismatch
from ckpt_tools.loading.state_dict import LoadInfo, _selection_checked, load_with_info
from ckpt_tools.structure.grouping import fold_keys
from ckpt_tools.structure.keys import rename_keys
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

logger = logging.getLogger("ckpt_tools")


def _mismatch_message(
    report: LoadReport,
    select: Select,
    source_keys: Sequence[str],
    model_keys: Sequence[str],
    applied: KeyFix | None,
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
        shown = ", ".join(str(m) for m in report.shape_mismatches[:4])
        more = " ..." if len(report.shape_mismatches) > 4 else ""
        lines.append(f"  {len(report.shape_mismatches)} shape mismatch(es): {shown}{more}")
    # A rewrite of the keys as stored (the command acts on the file) that does better than
    # the wrapper rewrite applied here.
    fixes = rank_fixes(source_keys, model_keys) if report.unexpected else ()
    done = (
        applied.matched if applied is not None else sum(k in set(model_keys) for k in source_keys)
    )
    if fixes and fixes[0].matched > done:
        fix = fixes[0]
        how = (
            fix_command(report.source, fix.steps, select)
            if report.info is not None
            else fix_python(fix.steps)
        )
        lines.append(
            f"  {fix.describe()} resolves {fix.resolved} of {fix.unmatched} unexpected keys: {how}"
        )
    lines.append(
        "Pass strict=False to load the keys that match and get the rest in the report, or "
        f"run `ckpt diff {report.source if report.source != '<state dict>' else 'CKPT'} "
        "--model MODULE:FACTORY` to see every difference."
    )
    return "\n".join(lines)


def _source_state_dict(
    source: StrPath | Mapping[str, Any],
    map_location: MapLocation,
    select: Select,
    trust: bool,
) -> tuple[Mapping[str, Any], str, LoadInfo | None]:
    if isinstance(source, Mapping):
        if select is not None or not is_state_dict(source):
            source = _selection_checked(source, select, "<state dict>").state_dict
        return source, "<state dict>", None
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(
            f"load_into's src must be a checkpoint path or a state dict, got "
            f"{type(source).__name__}"
        )
    # The model's tensors are where the data ends up: stage on the CPU (memory-mapped) and
    # copy once, rather than holding a second copy on the GPU.
    location = "cpu" if isinstance(map_location, str) and map_location == "auto" else map_location
    sd, info = load_with_info(source, map_location=location, select=select, trust=trust)
    if location is not map_location:
        info = replace(info, map_location="auto (staged on cpu)")
    return sd, info.path, info


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


def load_into(
    model: nn.Module,
    src: StrPath | Mapping[str, Any],
    *,
    strict: bool = True,
    map_location: MapLocation = "auto",
    select: Select = None,
    trust: bool = False,
    assign: bool | None = None,
) -> LoadReport:
    """Load a checkpoint into a model, reconciling wrapper prefixes on both sides.

    The wrapper stacks of the model's keys (plain, ``nn.DataParallel``/DDP ``module.``,
    ``torch.compile``'s ``_orig_mod.``, a Lightning-style ``model.`` attribute ...) and of
    the checkpoint's keys are compared (:func:`ckpt_tools.structure.suggest.best_fix`), and the
    checkpoint's keys are rewritten with :mod:`ckpt_tools.structure.keys` rules to match.

    Args:
        model: the target module (wrapped or not).
        src: a checkpoint path, or an in-memory state dict (or a dict holding one).
        strict: with True, any missing or unexpected key or shape mismatch raises and the
            model is left untouched; with False, matching keys load and the rest is reported
            (shape mismatches are skipped, where ``nn.Module.load_state_dict`` would raise).
        map_location: as for :func:`load_state_dict`; ``"auto"`` here stages storages on
            the CPU (memory-mapped) since they are copied into the model's tensors anyway.
        select: dotted path to the state dict inside the checkpoint.
        trust: see :func:`load_state_dict`.
        assign: make the loaded tensors the model's own
            (``model.load_state_dict(..., assign=True)``) instead of copying into them.
            Default (None): True exactly when the model has parameters or buffers on the
            ``meta`` device, so a model built under ``torch.device("meta")`` gets tensors
            backed by the memory-mapped file (nothing allocated, nothing copied) and
            loading a model larger than half the RAM works. With ``assign``, the
            checkpoint's dtypes and devices are kept (nothing is cast).

    Returns:
        A :class:`LoadReport`.

    Raises:
        StateDictMismatchError: ``strict=True`` and the keys or shapes differ; the message
            lists them (repeated layers folded) and says how to proceed.
        UsageError, UnsafeContentError, CheckpointError: see :func:`load_state_dict`.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(4, 2)
        >>> torch.save({f"module.{k}": v for k, v in net.state_dict().items()}, "dp.pt")  # DDP keys
        >>> report = load_into(torch.nn.Linear(4, 2), "dp.pt")
        >>> report.rewrites
        ("stripping 'module.'",)
    """
    torch = require_torch("load_into")
    from ckpt_tools.loading.tensor_io import dtype_name

    sd, label, info = _source_state_dict(src, map_location, select, trust)
    assign = on_meta(model) if assign is None else assign
    target = model.state_dict()
    model_keys = list(target)
    source_keys = [str(k) for k in sd]
    fix = best_fix(source_keys, model_keys)
    if fix is not None:
        sd = rename_keys(sd, fix.rules)
        logger.info("%s: %s to match %s", label, fix.describe(), type(model).__name__)
    missing = tuple(k for k in model_keys if k not in sd)
    unexpected = tuple(k for k in sd if k not in target)
    shapes, casts = [], []
    for key, value in sd.items():
        have = target.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor)):
            continue
        if value.shape != have.shape:
            shapes.append(ShapeMismatch(key, tuple(value.shape), tuple(have.shape)))
        elif value.dtype != have.dtype:
            casts.append((key, dtype_name(value.dtype), dtype_name(have.dtype)))
    report = LoadReport(
        source=label,
        model_class=type(model).__name__,
        model_layout=tuple(m.prefix for m in wrapper_stack(model_keys)),
        checkpoint_layout=tuple(m.prefix for m in wrapper_stack(source_keys)),
        rewrites=tuple(step.describe() for step in fix.steps) if fix else (),
        loaded=0,
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=tuple(shapes),
        dtype_casts=() if assign else tuple(casts),
        info=info,
        assigned=assign,
    )
    if strict and not report.ok:
        raise StateDictMismatchError(
            _mismatch_message(report, select, source_keys, model_keys, fix)
        )
    return _load(model, sd, report, target, strict=strict)


def _load(
    model: nn.Module,
    sd: Mapping[str, Any],
    report: LoadReport,
    target: Mapping[str, Any],
    *,
    strict: bool,
) -> LoadReport:
    """``model.load_state_dict`` of the keys whose shapes match; ``report`` completed."""
    skip = {m.key for m in report.shape_mismatches}
    filtered: Any = OrderedDict((k, v) for k, v in sd.items() if k not in skip)
    if getattr(sd, "_metadata", None) is not None:
        filtered._metadata = sd._metadata  # type: ignore[attr-defined]
    try:
        result = model.load_state_dict(filtered, strict=strict, assign=report.assigned)
    except RuntimeError as e:
        raise StateDictMismatchError(
            f"{report.source}: {type(model).__name__}.load_state_dict refused the state dict: {e}"
        ) from e
    # torch's assign leaves what no state dict holds on meta, and says nothing.
    named = (*model.named_parameters(), *model.named_buffers()) if report.assigned else ()
    return replace(
        report,
        left_on_meta=tuple(name for name, t in named if t.is_meta),
        loaded=sum(1 for k in filtered if k in target),
        missing=tuple(k for k in result.missing_keys if k not in skip),
        unexpected=tuple(result.unexpected_keys),
    )
