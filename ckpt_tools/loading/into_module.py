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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ckpt_tools.loading.devices import MapLocation
from ckpt_tools.errors import StateDictMismatchError, UsageError
from ckpt_tools.structure.grouping import group_names
from ckpt_tools.structure.keys import rename_keys
from ckpt_tools.structure.selection import is_state_dict
from ckpt_tools.loading.state_dict import LoadInfo, _selection_checked, load_state_dict
from ckpt_tools.structure.suggest import (
    KeyFix,
    best_fix,
    fix_command,
    fix_python,
    rank_fixes,
    wrapper_stack,
)
from ckpt_tools.loading.tensor_io import dtype_name

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LoadReport", "ShapeMismatch", "fold_keys", "load_into"]

logger = logging.getLogger("ckpt_tools")


@dataclass(frozen=True)
class ShapeMismatch:
    """A key whose tensor shape differs between checkpoint and model."""

    key: str
    checkpoint: tuple[int, ...]
    model: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "checkpoint": list(self.checkpoint), "model": list(self.model)}


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_into` did.

    Attributes:
        source: the checkpoint path, or ``<state dict>``.
        model: the model's class name.
        model_layout: wrapper prefixes of the model's keys, outermost first.
        checkpoint_layout: wrapper prefixes of the checkpoint's keys, outermost first.
        rewrites: the key rewrites applied to the checkpoint (``stripping 'module.'``).
        loaded: keys copied into the model.
        missing: model keys the checkpoint lacks (after the rewrites).
        unexpected: checkpoint keys the model lacks (after the rewrites).
        shape_mismatches: keys present in both with different shapes (skipped).
        dtype_casts: ``(key, checkpoint dtype, model dtype)`` copied with a cast.
        info: how the file was loaded; None for an in-memory state dict.
    """

    source: str
    model: str
    model_layout: tuple[str, ...]
    checkpoint_layout: tuple[str, ...]
    rewrites: tuple[str, ...]
    loaded: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shape_mismatches: tuple[ShapeMismatch, ...] = ()
    dtype_casts: tuple[tuple[str, str, str], ...] = ()
    info: LoadInfo | None = None

    @property
    def ok(self) -> bool:
        """Every key matched in name and shape."""
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def __str__(self) -> str:
        how = f" ({', '.join(self.rewrites)})" if self.rewrites else ""
        lines = [f"loaded {self.loaded} keys from {self.source} into {self.model}{how}"]
        if self.missing:
            lines.append(f"missing ({len(self.missing)}): {fold_keys(self.missing)}")
        if self.unexpected:
            lines.append(f"unexpected ({len(self.unexpected)}): {fold_keys(self.unexpected)}")
        for m in self.shape_mismatches:
            lines.append(
                f"shape mismatch, skipped: {m.key} checkpoint {list(m.checkpoint)} vs model "
                f"{list(m.model)}"
            )
        if self.dtype_casts:
            lines.append(f"cast to the model's dtype: {len(self.dtype_casts)} keys")
        if self.info is not None and self.info.moved:
            moved = ", ".join(f"{m.saved} -> {m.target}" for m in self.info.moved)
            lines.append(f"devices: {moved}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "model": self.model,
            "model_layout": list(self.model_layout),
            "checkpoint_layout": list(self.checkpoint_layout),
            "rewrites": list(self.rewrites),
            "loaded": self.loaded,
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "shape_mismatches": [m.to_json() for m in self.shape_mismatches],
            "dtype_casts": [list(c) for c in self.dtype_casts],
            "info": self.info.to_json() if self.info else None,
        }


def fold_keys(keys: Sequence[str], limit: int = 6) -> str:
    """``layers.{0..11}.attn.weight ×12, head.bias`` (at most ``limit`` groups)."""
    groups = [g for g, _ in group_names(keys, str)]
    shown = [g.pattern + (f" ×{g.count}" if g.count > 1 else "") for g in groups[:limit]]
    more = f", ... ({len(groups) - limit} more groups)" if len(groups) > limit else ""
    return ", ".join(shown) + more


def _mismatch_message(
    report: LoadReport,
    select: str | Sequence[str] | None,
    source_keys: Sequence[str],
    model_keys: Sequence[str],
    applied: KeyFix | None,
) -> str:
    parts = [f"{report.source} does not match {report.model}"]
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
        shown = ", ".join(
            f"{m.key} checkpoint {list(m.checkpoint)} vs model {list(m.model)}"
            for m in report.shape_mismatches[:4]
        )
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
    source: str | os.PathLike[str] | Mapping[str, Any],
    map_location: MapLocation,
    select: str | Sequence[str] | None,
    trust: bool,
) -> tuple[Mapping[str, Any], str, LoadInfo | None]:
    if isinstance(source, Mapping):
        if select is not None or not is_state_dict(source):
            source = _selection_checked(source, select, "<state dict>").state_dict
        return source, "<state dict>", None
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(
            f"load_into source must be a checkpoint path or a state dict, got "
            f"{type(source).__name__}"
        )
    # The model's tensors are where the data ends up: stage on the CPU (memory-mapped) and
    # copy once, rather than holding a second copy on the GPU.
    location = "cpu" if isinstance(map_location, str) and map_location == "auto" else map_location
    sd, info = load_state_dict(
        source, map_location=location, select=select, trust=trust, return_info=True
    )
    if location is not map_location:
        info = replace(info, map_location="auto (staged on cpu)")
    return sd, info.path, info


def load_into(
    model: nn.Module,
    source: str | os.PathLike[str] | Mapping[str, Any],
    strict: bool = True,
    map_location: MapLocation = "auto",
    select: str | Sequence[str] | None = None,
    trust: bool = False,
) -> LoadReport:
    """Load a checkpoint into a model, reconciling wrapper prefixes on both sides.

    The wrapper stacks of the model's keys (plain, ``nn.DataParallel``/DDP ``module.``,
    ``torch.compile``'s ``_orig_mod.``, a Lightning-style ``model.`` attribute ...) and of
    the checkpoint's keys are compared (:func:`ckpt_tools.structure.suggest.best_fix`), and the
    checkpoint's keys are rewritten with :mod:`ckpt_tools.structure.keys` rules to match.

    Args:
        model: the target module (wrapped or not).
        source: a checkpoint path, or an in-memory state dict (or a dict holding one).
        strict: with True, any missing or unexpected key or shape mismatch raises and the
            model is left untouched; with False, matching keys load and the rest is reported
            (shape mismatches are skipped, where ``nn.Module.load_state_dict`` would raise).
        map_location: as for :func:`load_state_dict`; ``"auto"`` here stages storages on
            the CPU (memory-mapped) since they are copied into the model's tensors anyway.
        select: dotted path to the state dict inside the checkpoint.
        trust: see :func:`load_state_dict`.

    Returns:
        A :class:`LoadReport`.

    Raises:
        StateDictMismatchError: ``strict=True`` and the keys or shapes differ; the message
            lists them (repeated layers folded) and says how to proceed.
        UsageError, UnsafeContentError, CheckpointError: see :func:`load_state_dict`.

    Example:
        >>> report = load_into(torch.compile(Net()), "ddp.pt")  # doctest: +SKIP
        >>> report.rewrites  # doctest: +SKIP
        ("stripping 'module.'", "adding '_orig_mod.'")
    """
    sd, label, info = _source_state_dict(source, map_location, select, trust)
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
        model=type(model).__name__,
        model_layout=tuple(m.prefix for m in wrapper_stack(model_keys)),
        checkpoint_layout=tuple(m.prefix for m in wrapper_stack(source_keys)),
        rewrites=tuple(step.describe() for step in fix.steps) if fix else (),
        loaded=0,
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=tuple(shapes),
        dtype_casts=tuple(casts),
        info=info,
    )
    if strict and not report.ok:
        raise StateDictMismatchError(
            _mismatch_message(report, select, source_keys, model_keys, fix)
        )
    skip = {m.key for m in shapes}
    filtered: Any = OrderedDict((k, v) for k, v in sd.items() if k not in skip)
    if getattr(sd, "_metadata", None) is not None:
        filtered._metadata = sd._metadata  # type: ignore[attr-defined]
    try:
        result = model.load_state_dict(filtered, strict=strict)
    except RuntimeError as e:
        raise StateDictMismatchError(
            f"{label}: {type(model).__name__}.load_state_dict refused the state dict: {e}"
        ) from e
    loaded = sum(1 for k in filtered if k in target)
    return replace(
        report,
        loaded=loaded,
        missing=tuple(k for k in result.missing_keys if k not in skip),
        unexpected=tuple(result.unexpected_keys),
    )
