"""The files the parity checks compare, read the plain way, and compared by ckpt_tools' engine.

The reference side of every check is read with ``torch.load(weights_only=True)``, not
with ckpt_tools' readers, so a bug in the code under test cannot hide in its own
reference. The comparison itself is :func:`ckpt_tools.diffing.diff`, the engine behind
``ckpt diff``: "bitwise" there means same dtype, same shape and same bytes (``-0.0``
differs from ``0.0``, a NaN equals the same NaN), which is what a lossless rewrite keeps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckpt_tools.diffing.engine import diff
from ckpt_tools.diffing.report import DiffReport
from ckpt_tools.diffing.value_stats import compare_tensors
from ckpt_tools.formats.detect import detect_format
from ckpt_tools.harness.config import STEPS_DIR

__all__ = ["compare_state_dicts", "load_pt", "step_gaps", "storage_tags"]


def load_pt(path: str | Path) -> dict[str, Any]:
    """Read a ``.pt`` file the plain way, as the reference the checks compare against.

    ``torch.load`` onto the CPU with ``weights_only=True``: ckpt_tools' readers are not
    involved, so a bug in the code under test cannot hide in its own reference.

    Args:
        path: a ``torch.save`` file.

    Returns:
        Whatever was saved, tensors on the CPU.

    Raises:
        CheckpointNotFoundError: there is no such file.
        UnsupportedFormatError: the file is not a checkpoint.
        pickle.UnpicklingError: the file holds objects ``weights_only`` refuses.

    Example:
        >>> load_pt("out/ddp/bare.pt")["net.1.weight"].device
        device(type='cpu')
    """
    detect_format(path)  # the same CheckpointNotFoundError as every ckpt_tools reader
    return torch.load(path, map_location="cpu", weights_only=True)


def storage_tags(path: str | Path) -> set[str]:
    """The device tags (``"cpu"``, ``"cuda:1"``) recorded for the storages in a ``.pt`` file.

    A ``map_location`` callable sees each storage's saved location before placing it;
    returning the (CPU) storage unchanged reads any tag on any machine, GPU or not.

    Args:
        path: a ``torch.save`` file.

    Returns:
        The set of saved location tags.

    Raises:
        CheckpointNotFoundError: there is no such file.

    Example:
        >>> storage_tags("out/ddp/bare.pt")
        {'cpu'}
    """
    seen: set[str] = set()

    def record(storage: Any, location: str) -> Any:
        seen.add(location)
        return storage

    detect_format(path)
    torch.load(path, map_location=record, weights_only=True)
    return seen


def _gap(report: DiffReport, *, bitwise: bool) -> tuple[float, list[str]]:
    """The largest value gap of a :func:`diff` report, and what breaks the comparison."""
    keys = (("missing", report.missing), ("unexpected", report.unexpected))
    problems = [f"{label} keys {list(names[:3])}" for label, names in keys if names]
    gaps = [t.max_abs for t in report.tensors if t.max_abs is not None]
    # The diff engine measures |a - b| where neither side is NaN; a NaN on one side only
    # has no distance, and a gap of 0.0 beside a failure would not explain it.
    nan_apart = {t.name for t in report.tensors if t.nan_a != t.nan_b}
    worst = math.nan if nan_apart else max(gaps, default=0.0)
    if problems or report.shape_mismatches:
        worst = math.inf
    for t in report.tensors:
        if t.name in nan_apart:
            problems.append(f"{t.name}: {t.nan_a} NaN, expected {t.nan_b}")
        elif t.status in ("shape", "dtype"):
            problems.append(
                f"{t.name}: {t.dtype_a}{list(t.shape_a)}, expected {t.dtype_b}{list(t.shape_b)}"
            )
        elif bitwise and not t.bit_equal:
            problems.append(f"{t.name}: bytes differ")
        elif t.status == "differ":
            problems.append(f"{t.name}: values differ by more than {report.atol:g}")
    return worst, problems


def compare_state_dicts(
    ref: Mapping[str, Any], got: Mapping[str, Any], *, tolerance: float = 0.0
) -> tuple[float, list[str]]:
    """Compare two flat state dicts tensor by tensor with :func:`ckpt_tools.diffing.diff`.

    Args:
        ref: the expected state dict.
        got: the one to check.
        tolerance: 0.0 requires the same dtype, shape and bytes; above it, values may
            differ by up to ``tolerance`` (absolute), and integer tensors
            (``num_batches_tracked``) must still be equal.

    Returns:
        ``(largest |got - ref| over all tensors, problems)``; the gap is ``inf`` when keys
        or shapes do not line up, ``nan`` when a tensor has NaNs on one side that the other
        does not, and ``problems`` names every key that breaks the comparison (missing,
        unexpected, dtype or shape, NaNs, values or bytes).

    Example:
        >>> compare_state_dicts({"w": torch.ones(2)}, {"w": torch.ones(2)})
        (0.0, [])
        >>> compare_state_dicts({"w": torch.zeros(1)}, {"w": torch.tensor([-0.0])})
        (0.0, ['w: bytes differ'])
        >>> compare_state_dicts({"w": torch.zeros(2)}, {"w": torch.tensor([0.0, math.nan])})
        (nan, ['w: 1 NaN, expected 0'])
    """
    report = diff(dict(got), dict(ref), rtol=0.0, atol=tolerance)
    return _gap(report, bitwise=tolerance == 0.0)


def step_gaps(run_dir: str | Path, single_dir: str | Path) -> tuple[float, ...]:
    """Per step, the largest ``|w - w_single|`` over every parameter of two recorded runs.

    Both runs were trained with ``record_steps`` (:class:`ckpt_tools.harness.loop.StepRecorder`
    saved ``steps/00001.pt`` ...); each step's parameters are read with
    ``torch.load(weights_only=True)`` and compared pairwise by the diff engine's
    :func:`~ckpt_tools.diffing.value_stats.compare_tensors`.

    Args:
        run_dir: a strategy's output folder.
        single_dir: the single-device run's output folder.

    Returns:
        One gap per step both runs recorded, in step order: 0.0 where every parameter is
        equal in value, ``inf`` where the parameters do not pair up (count or shapes).

    Example:
        >>> from ckpt_tools.harness import TrainConfig, train
        >>> for strategy in ("single", "manual"):
        ...     run = TrainConfig(strategy=strategy, world_size=2, steps=2, device="cpu",
        ...                       out_dir=f"runs/{strategy}", record_steps=True)
        ...     _ = train(run)
        >>> [gap < 1e-5 for gap in step_gaps("runs/manual", "runs/single")]
        [True, True]
    """
    mine, base = Path(run_dir) / STEPS_DIR, Path(single_dir) / STEPS_DIR
    gaps: list[float] = []
    for ref_path in sorted(base.glob("*.pt")):
        if not (mine / ref_path.name).is_file():
            break
        ref = torch.load(ref_path, map_location="cpu", weights_only=True)
        got = torch.load(mine / ref_path.name, map_location="cpu", weights_only=True)
        if len(ref) != len(got) or any(a.shape != b.shape for a, b in zip(got, ref)):
            gaps.append(math.inf)
            continue
        stats = [compare_tensors(a, b) for a, b in zip(got, ref)]
        gaps.append(max((s.max_abs for s in stats), default=0.0))
    return tuple(gaps)
