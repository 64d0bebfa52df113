"""The five parity checks, run on the files training wrote, each giving a :class:`CheckResult`.

(a) ``strip_prefix``: wrapped checkpoint -> ``ckpt_tools.structure.wrappers.strip_prefix`` -> bare
    model, outputs bitwise equal to the wrapped model's.
(b) ``add_prefix``: bare checkpoint -> ``ckpt_tools.structure.wrappers.add_prefix`` ->
    ``nn.DataParallel``, outputs bitwise equal to the bare model's.
(c) ``vs_single``: a strategy's final weights against single-device training's.
(d) ``device_roundtrip``: a GPU-saved checkpoint (or, without a GPU, one retagged to
    ``cuda:1`` with ``ckpt_tools.ops.rewrite.rewriting.retag``) loaded with
    ``ckpt_tools.loading.state_dict.load_state_dict(map_location="auto")``, bitwise equal.
(e) ``format_roundtrip``: pt -> safetensors -> pt with ``ckpt_tools.ops.rewrite.rewriting.convert``,
    bitwise equal.

Values are compared by ckpt_tools' one comparison engine: :func:`ckpt_tools.diffing.diff`
for state dicts, :func:`ckpt_tools.diffing.value_stats.compare_tensors` for model outputs.
A check turns only the failures it expects into a ``fail`` row (:data:`FINDINGS`); any
other exception is a bug of the harness and propagates.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ckpt_tools.diffing.value_stats import compare_tensors
from ckpt_tools.errors import CheckpointError, StateDictMismatchError
from ckpt_tools.harness.data import synthetic_fashion
from ckpt_tools.harness.loop import deterministic
from ckpt_tools.harness.models import build_harness_model
from ckpt_tools.harness.parity.reference import compare_state_dicts, load_pt, storage_tags
from ckpt_tools.loading.state_dict import load_state_dict
from ckpt_tools.ops.rewrite.conversion import convert, retag
from ckpt_tools.structure.wrappers import add_prefix, strip_prefix

__all__ = [
    "CHECK_NAMES",
    "FINDINGS",
    "CheckResult",
    "check_add_prefix",
    "check_device_roundtrip",
    "check_format_roundtrip",
    "check_strip_prefix",
    "check_vs_single",
]

#: Check names in report order, (a) to (e).
CHECK_NAMES: tuple[str, ...] = (
    "strip_prefix",
    "add_prefix",
    "vs_single",
    "device_roundtrip",
    "format_roundtrip",
)
#: The failures a check reports as its finding (a ``fail`` row) instead of raising:
#: ckpt_tools' own refusals of the files under test (a missing file is a
#: CheckpointNotFoundError, a state dict the model refuses a StateDictMismatchError), and
#: the UnpicklingError of torch's ``weights_only`` reader refusing a global.
FINDINGS: tuple[type[Exception], ...] = (CheckpointError, pickle.UnpicklingError)


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one parity check.

    Attributes:
        name: one of :data:`CHECK_NAMES`.
        passed: the property holds. ``not comparable`` rows count as passed (there was
            nothing to hold).
        max_abs_diff: largest absolute elementwise difference seen (``inf`` when shapes or
            keys do not even line up).
        tolerance: the allowed ``max_abs_diff``; 0.0 for bitwise checks, ``None`` when
            the comparison is not meaningful.
        detail: what was compared, and why it failed if it did.
        strategy: the strategy whose checkpoints were checked.
        status: ``pass``, ``fail``, ``baseline``, ``not comparable`` or ``skipped`` (the
            strategy could not run here: ``detail`` says why and how to install it).
        error: the class name of the :data:`FINDINGS` error that failed the check, or ``""``.
    """

    name: str
    passed: bool
    max_abs_diff: float
    tolerance: float | None
    detail: str
    strategy: str = ""
    status: str = "pass"
    error: str = ""


def _result(
    name: str, strategy: str, diff_: float, tol: float | None, ok: bool, detail: str
) -> CheckResult:
    return CheckResult(name, ok, diff_, tol, detail, strategy, "pass" if ok else "fail")


def _attempt(
    name: str, strategy: str, tol: float | None, body: Callable[[], CheckResult]
) -> CheckResult:
    """Run a check's body; an expected failure (:data:`FINDINGS`) becomes a ``fail`` row."""
    try:
        return body()
    except FINDINGS as exc:
        detail = f"{type(exc).__name__}: {exc}"
        return CheckResult(name, False, math.inf, tol, detail, strategy, "fail", type(exc).__name__)


def eval_device() -> torch.device:
    """Where (a)/(b) run both models: the current GPU if any, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fresh(model: str, model_kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
    return build_harness_model(model, **dict(model_kwargs)).to(device).eval()


def _data_parallel(model: nn.Module, device: torch.device) -> nn.DataParallel:
    # One device: DataParallel forwards without scattering, so any output difference is
    # the checkpoint's fault, not the reduction order of a multi-GPU gather.
    if device.type == "cuda":
        return nn.DataParallel(model, device_ids=[device.index], output_device=device.index)
    return nn.DataParallel(model)  # no CUDA: a plain forward


def _load_strict(module: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """``load_state_dict(strict=True)``; torch's RuntimeError on a mismatch becomes ours."""
    try:
        module.load_state_dict(state_dict, strict=True)
    except RuntimeError as exc:  # what torch raises for missing, unexpected or reshaped keys
        raise StateDictMismatchError(
            f"{type(module).__name__}.load_state_dict refused the state dict: {exc}"
        ) from exc


def _outputs(model: nn.Module, device: torch.device) -> Tensor:
    # eval(): BatchNorm uses the loaded running statistics, so buffers are checked too.
    images = synthetic_fashion(16, seed=1234).tensors[0].to(device)
    with torch.no_grad(), deterministic():
        return model(images)


def _prefix_check(
    name: str,
    path: str | Path,
    model: str,
    kw: Mapping[str, Any] | None,
    strategy: str,
    same_as: str | Path | None = None,
) -> CheckResult:
    """(a) and (b): load the file into one form of the model, its rewrite into the other;
    with ``same_as``, the rewrite must also be that file's state dict, bit for bit."""
    device, kw = eval_device(), kw or {}
    # Built before the attempt: an unknown model is the caller's UsageError, not a finding.
    bare = _fresh(model, kw, device)
    wrapped = _data_parallel(_fresh(model, kw, device), device)
    saved_wrapped = name == "strip_prefix"
    source, target = (wrapped, bare) if saved_wrapped else (bare, wrapped)
    rewrite = strip_prefix if saved_wrapped else add_prefix

    def body() -> CheckResult:
        state_dict = load_pt(path)
        if same_as is not None:  # the run's own two files: one state dict, two key forms
            rewritten = rewrite(state_dict, prefix="module.")
            gap, problems = compare_state_dicts(load_pt(same_as), rewritten)
            if problems:
                detail = f"not {Path(same_as).name}'s weights: {'; '.join(problems[:3])}"
                return _result(name, strategy, gap, 0.0, False, detail)
        _load_strict(source, state_dict)
        _load_strict(target, rewrite(state_dict, prefix="module."))
        stats = compare_tensors(_outputs(target, device), _outputs(source, device))
        detail = (
            f"{len(state_dict)} tensors, strict load into {type(target).__name__}, outputs "
            f"on {device} " + ("bitwise equal" if stats.bit_equal else "differ")
        )
        return _result(name, strategy, stats.max_abs, 0.0, stats.bit_equal, detail)

    return _attempt(name, strategy, 0.0, body)


def check_strip_prefix(
    wrapped_path: str | Path,
    model: str,
    model_kwargs: Mapping[str, Any] | None = None,
    strategy: str = "",
    bare_path: str | Path | None = None,
) -> CheckResult:
    """(a) Wrapped checkpoint, ``module.`` stripped, into the bare model: same outputs.

    Args:
        wrapped_path: a ``wrapped.pt`` (``module.`` keys).
        model: the model name it was trained as.
        model_kwargs: the model's extra arguments.
        strategy: label for the result.
        bare_path: the same run's ``bare.pt``, which the stripped dict must equal bit for
            bit (the run saved one state dict twice); None skips that comparison.

    Returns:
        Passed when the stripped dict is ``bare_path``'s, loads with ``strict=True``, and
        the bare model's outputs are bitwise equal to the ``nn.DataParallel`` model's on the
        same batch; a :data:`FINDINGS` error is a failed result naming it.

    Raises:
        UsageError: ``model`` or ``model_kwargs`` name no harness model.

    Example:
        >>> check_strip_prefix("out/ddp/wrapped.pt", "mlp", {"hidden": (4,)}).passed
        True
    """
    return _prefix_check("strip_prefix", wrapped_path, model, model_kwargs, strategy, bare_path)


def check_add_prefix(
    bare_path: str | Path,
    model: str,
    model_kwargs: Mapping[str, Any] | None = None,
    strategy: str = "",
) -> CheckResult:
    """(b) Bare checkpoint, ``module.`` added, into ``nn.DataParallel(model)``: same outputs.

    Args:
        bare_path: a ``bare.pt``.
        model: the model name it was trained as.
        model_kwargs: the model's extra arguments.
        strategy: label for the result.

    Returns:
        Passed when the prefixed dict loads into DataParallel with ``strict=True`` and its
        outputs are bitwise equal to the bare model's; a :data:`FINDINGS` error is a
        failed result naming it.

    Raises:
        UsageError: ``model`` or ``model_kwargs`` name no harness model.

    Example:
        >>> check_add_prefix("out/single/bare.pt", "mlp", {"hidden": (4,)}).passed
        True
    """
    return _prefix_check("add_prefix", bare_path, model, model_kwargs, strategy)


def check_vs_single(
    bare_path: str | Path,
    single_path: str | Path,
    tolerance: float,
    strategy: str = "",
    comparable: bool = True,
    why_not: str = "",
) -> CheckResult:
    """(c) A strategy's final weights against single-device training's, within ``tolerance``.

    Args:
        bare_path: the strategy's ``bare.pt``.
        single_path: the single-device run's ``bare.pt`` (same seed, global batch, steps).
        tolerance: allowed max abs difference over every floating tensor.
        strategy: label for the result.
        comparable: ``False`` when the strategy legitimately computes something else
            (BatchNorm statistics per replica); the gap is then reported, not judged.
        why_not: the reason, when not comparable.

    Returns:
        The comparison; integer tensors (``num_batches_tracked``) must match exactly. A
        :data:`FINDINGS` error (a missing file) is a failed result naming it.

    Example:
        >>> check_vs_single("out/ddp/bare.pt", "out/single/bare.pt", 1e-5).passed
        True
    """
    name = "vs_single"

    def body() -> CheckResult:
        gap, problems = compare_state_dicts(
            load_pt(single_path), load_pt(bare_path), tolerance=tolerance
        )
        if Path(bare_path).resolve() == Path(single_path).resolve():
            return CheckResult(name, True, 0.0, None, "the baseline", strategy, "baseline")
        if not comparable:
            detail = f"not exactly comparable ({why_not}); measured gap {gap:.3g}"
            return CheckResult(name, True, gap, None, detail, strategy, "not comparable")
        detail = f"final weights vs single-device, atol {tolerance:g}" + (
            f": {'; '.join(problems[:3])}" if problems else ""
        )
        return _result(name, strategy, gap, tolerance, not problems, detail)

    return _attempt(name, strategy, tolerance, body)


def _gpu_tagged(source: Path, work_dir: str | Path) -> tuple[Path, str, list[str]]:
    """The checkpoint to load with ``map_location="auto"``: as saved when a GPU saved it,
    else a copy retagged ``cpu -> cuda:1``; with how it was made, and any problems."""
    if any(tag.startswith("cuda") for tag in storage_tags(source)):
        return source, "saved on GPU", []
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    target = Path(work_dir) / f"{source.stem}.cuda1.pt"
    target.unlink(missing_ok=True)
    retag(source, target, mapping={"cpu": "cuda:1"})
    tags = storage_tags(target)
    problems = [] if tags == {"cuda:1"} else [f"retag left storage tags {sorted(tags)}"]
    return target, "retagged cpu->cuda:1", problems


def check_device_roundtrip(
    path: str | Path, work_dir: str | Path, strategy: str = ""
) -> CheckResult:
    """(d) Load a GPU-tagged checkpoint with ``map_location="auto"``; bitwise equal.

    A checkpoint saved from a GPU is loaded as is. A CPU-saved one is first retagged
    ``cpu -> cuda:1`` with ``ckpt_tools.retag`` into ``work_dir``, which is what a
    GPU save looks like to a CPU-only machine.

    Args:
        path: a ``.pt`` state dict.
        work_dir: where the retagged copy goes (created if missing).
        strategy: label for the result.

    Returns:
        Passed when every tensor comes back with the same dtype, shape and bytes (and, on
        a CPU-only machine, on the CPU); a :data:`FINDINGS` error is a failed result.

    Example:
        >>> check_device_roundtrip("out/ddp/wrapped.pt", "out/ddp/parity").passed
        True
    """
    name = "device_roundtrip"

    def body() -> CheckResult:
        source = Path(path)
        tagged, route, problems = _gpu_tagged(source, work_dir)
        loaded = load_state_dict(tagged, map_location="auto")
        devices = sorted({str(t.device) for t in loaded.values() if isinstance(t, Tensor)})
        gap, mismatches = compare_state_dicts(load_pt(source), loaded)
        problems += mismatches
        if not torch.cuda.is_available() and devices not in ([], ["cpu"]):
            problems.append(f"map_location='auto' left tensors on {devices} without a GPU")
        detail = f"{route}, load_state_dict(map_location='auto') -> {','.join(devices)}" + (
            f": {'; '.join(problems[:3])}" if problems else ", bitwise equal"
        )
        return _result(name, strategy, gap, 0.0, not problems, detail)

    return _attempt(name, strategy, 0.0, body)


def check_format_roundtrip(
    path: str | Path, work_dir: str | Path, strategy: str = ""
) -> CheckResult:
    """(e) pt -> safetensors -> pt with ``ckpt_tools.ops.rewrite.rewriting.convert``; bitwise equal.

    Args:
        path: a ``.pt`` state dict.
        work_dir: where ``<stem>.safetensors`` and ``<stem>.roundtrip.pt`` go.
        strategy: label for the result.

    Returns:
        Passed when the twice-converted file holds the same keys, dtypes, shapes and
        bytes; a :data:`FINDINGS` error is a failed result naming it.

    Example:
        >>> check_format_roundtrip("out/ddp/wrapped.pt", "out/ddp/parity").passed
        True
    """
    name = "format_roundtrip"

    def body() -> CheckResult:
        source, work = Path(path), Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
        middle = work / f"{source.stem}.safetensors"
        back = work / f"{source.stem}.roundtrip.pt"
        for stale in (middle, back):  # a re-run must not trip over its own old outputs
            stale.unlink(missing_ok=True)
        convert(source, middle)  # the format comes from the suffix
        convert(middle, back)
        gap, problems = compare_state_dicts(load_pt(source), load_pt(back))
        detail = "pt -> safetensors -> pt " + (
            f": {'; '.join(problems[:3])}" if problems else "bitwise equal"
        )
        return _result(name, strategy, gap, 0.0, not problems, detail)

    return _attempt(name, strategy, 0.0, body)
