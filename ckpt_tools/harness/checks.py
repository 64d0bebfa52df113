"""The five parity checks, run on the files training wrote, each giving a :class:`CheckResult`.

(a) ``strip_prefix``: wrapped checkpoint -> ``ckpt_tools.structure.keys.strip_prefix`` -> bare model,
    outputs bitwise equal to the wrapped model's.
(b) ``add_prefix``: bare checkpoint -> ``ckpt_tools.structure.keys.add_prefix`` -> ``nn.DataParallel``,
    outputs bitwise equal to the bare model's.
(c) ``vs_single``: a strategy's final weights against single-device training's.
(d) ``device_roundtrip``: a GPU-saved checkpoint (or, without a GPU, one retagged to
    ``cuda:1`` with ``ckpt_tools.ops.rewriting.retag``) loaded with
    ``ckpt_tools.loading.state_dict.load_state_dict(map_location="auto")``, bitwise equal.
(e) ``format_roundtrip``: pt -> safetensors -> pt with ``ckpt_tools.ops.rewriting.convert``,
    bitwise equal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ckpt_tools.harness.compare import (
    bitwise_equal,
    compare_state_dicts,
    load_pt,
    max_abs_diff,
    storage_tags,
)
from ckpt_tools.harness.data import synthetic_fashion
from ckpt_tools.harness.loop import deterministic
from ckpt_tools.harness.models import build_model
from ckpt_tools.structure.keys import add_prefix, strip_prefix
from ckpt_tools.loading.state_dict import load_state_dict
from ckpt_tools.ops.rewriting import convert, retag

__all__ = [
    "CHECK_NAMES",
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
        status: ``pass``, ``fail``, ``baseline`` or ``not comparable``.
    """

    name: str
    passed: bool
    max_abs_diff: float
    tolerance: float | None
    detail: str
    strategy: str = ""
    status: str = "pass"


def _result(
    name: str, strategy: str, diff: float, tol: float | None, ok: bool, detail: str
) -> CheckResult:
    return CheckResult(name, ok, diff, tol, detail, strategy, "pass" if ok else "fail")


def _failed(name: str, strategy: str, tol: float | None, exc: Exception) -> CheckResult:
    return CheckResult(
        name, False, math.inf, tol, f"{type(exc).__name__}: {exc}", strategy, status="fail"
    )


def eval_device() -> torch.device:
    """Where (a)/(b) run both models: the current GPU if any, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fresh(model: str, model_kwargs: Mapping[str, Any], device: torch.device) -> nn.Module:
    return build_model(model, **dict(model_kwargs)).to(device).eval()


def _data_parallel(model: nn.Module, device: torch.device) -> nn.DataParallel:
    # One device: DataParallel forwards without scattering, so any output difference is
    # the checkpoint's fault, not the reduction order of a multi-GPU gather.
    if device.type == "cuda":
        return nn.DataParallel(model, device_ids=[device.index], output_device=device.index)
    return nn.DataParallel(model)  # no CUDA: a plain forward


def _outputs(model: nn.Module, device: torch.device) -> Tensor:
    # eval(): BatchNorm uses the loaded running statistics, so buffers are checked too.
    images = synthetic_fashion(16, seed=1234).tensors[0].to(device)
    with torch.no_grad(), deterministic():
        return model(images)


def check_strip_prefix(
    wrapped_path: str | Path,
    model: str,
    model_kwargs: Mapping[str, Any] | None = None,
    strategy: str = "",
) -> CheckResult:
    """(a) Wrapped checkpoint, ``module.`` stripped, into the bare model: same outputs.

    Args:
        wrapped_path: a ``wrapped.pt`` (``module.`` keys).
        model: the model name it was trained as.
        model_kwargs: the model's extra arguments.
        strategy: label for the result.

    Returns:
        Passed when the stripped dict loads with ``strict=True`` and the bare model's
        outputs are bitwise equal to the ``nn.DataParallel`` model's on the same batch.

    Example:
        >>> check_strip_prefix("out/ddp/wrapped.pt", "mlp").passed  # doctest: +SKIP
        True
    """
    name = "strip_prefix"
    try:
        device, kw = eval_device(), model_kwargs or {}
        wrapped_sd = load_pt(wrapped_path)
        wrapped = _data_parallel(_fresh(model, kw, device), device)
        wrapped.load_state_dict(wrapped_sd, strict=True)
        bare = _fresh(model, kw, device)
        bare.load_state_dict(strip_prefix(wrapped_sd, "module."), strict=True)
        ref, got = _outputs(wrapped, device), _outputs(bare, device)
    except Exception as exc:  # any failure is this check's finding, not the report's end
        return _failed(name, strategy, 0.0, exc)
    ok = bitwise_equal(ref, got)
    detail = f"{len(wrapped_sd)} tensors, strict load, outputs on {device} " + (
        "bitwise equal" if ok else "differ"
    )
    return _result(name, strategy, max_abs_diff(ref, got), 0.0, ok, detail)


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
        outputs are bitwise equal to the bare model's.

    Example:
        >>> check_add_prefix("out/single/bare.pt", "mlp").passed  # doctest: +SKIP
        True
    """
    name = "add_prefix"
    try:
        device, kw = eval_device(), model_kwargs or {}
        bare_sd = load_pt(bare_path)
        bare = _fresh(model, kw, device)
        bare.load_state_dict(bare_sd, strict=True)
        wrapped = _data_parallel(_fresh(model, kw, device), device)
        wrapped.load_state_dict(add_prefix(bare_sd, "module."), strict=True)
        ref, got = _outputs(bare, device), _outputs(wrapped, device)
    except Exception as exc:  # any failure is this check's finding, not the report's end
        return _failed(name, strategy, 0.0, exc)
    ok = bitwise_equal(ref, got)
    detail = f"{len(bare_sd)} tensors, strict load into DataParallel, outputs " + (
        "bitwise equal" if ok else "differ"
    )
    return _result(name, strategy, max_abs_diff(ref, got), 0.0, ok, detail)


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
        The comparison; integer tensors (``num_batches_tracked``) must match exactly.

    Example:
        >>> check_vs_single("out/ddp/bare.pt", "out/single/bare.pt", 1e-5).passed  # doctest: +SKIP
        True
    """
    name = "vs_single"
    try:
        diff, problems = compare_state_dicts(
            load_pt(single_path), load_pt(bare_path), bitwise=False
        )
    except Exception as exc:  # unreadable file: a finding, not a crash
        return _failed(name, strategy, tolerance, exc)
    if Path(bare_path).resolve() == Path(single_path).resolve():
        return CheckResult(name, True, 0.0, None, "the baseline", strategy, "baseline")
    if not comparable:
        detail = f"not exactly comparable ({why_not}); measured gap {diff:.3g}"
        return CheckResult(name, True, diff, None, detail, strategy, "not comparable")
    ok = not problems and diff <= tolerance
    detail = f"final weights vs single-device, atol {tolerance:g}" + (
        f": {'; '.join(problems[:3])}" if problems else ""
    )
    return _result(name, strategy, diff, tolerance, ok, detail)


def check_device_roundtrip(
    path: str | Path, work_dir: str | Path, strategy: str = ""
) -> CheckResult:
    """(d) Load a GPU-tagged checkpoint with ``map_location="auto"``; bitwise equal.

    A checkpoint saved from a GPU is loaded as is. A CPU-saved one is first retagged
    ``cpu -> cuda:1`` with ``ckpt_tools.ops.rewriting.retag`` into ``work_dir``, which is what a
    GPU save looks like to a CPU-only machine.

    Args:
        path: a ``.pt`` state dict.
        work_dir: where the retagged copy goes (created if missing).
        strategy: label for the result.

    Returns:
        Passed when every tensor comes back with the same dtype, shape and bytes (and, on
        a CPU-only machine, on the CPU).

    Example:
        >>> check_device_roundtrip("out/ddp/wrapped.pt", "out/ddp/parity").passed  # doctest: +SKIP
        True
    """
    name = "device_roundtrip"
    tags = storage_tags(path)
    cuda_saved = any(tag.startswith("cuda") for tag in tags)
    try:
        source = Path(path)
        if cuda_saved:
            loaded, route = load_state_dict(source, map_location="auto"), "saved on GPU"
        else:
            Path(work_dir).mkdir(parents=True, exist_ok=True)
            target = Path(work_dir) / f"{source.stem}.cuda1.pt"
            target.unlink(missing_ok=True)
            retag(source, target, {"cpu": "cuda:1"})
            new_tags = storage_tags(target)
            if new_tags != {"cuda:1"}:
                raise AssertionError(f"retag left storage tags {sorted(new_tags)}")
            loaded, route = load_state_dict(target, map_location="auto"), "retagged cpu->cuda:1"
        devices = sorted({str(t.device) for t in loaded.values() if isinstance(t, Tensor)})
        diff, problems = compare_state_dicts(load_pt(source), loaded, bitwise=True)
    except Exception as exc:  # any failure is this check's finding, not the report's end
        return _failed(name, strategy, 0.0, exc)
    if not torch.cuda.is_available() and devices not in ([], ["cpu"]):
        problems.append(f"map_location='auto' left tensors on {devices} without a GPU")
    ok = not problems
    detail = f"{route}, load_state_dict(map_location='auto') -> {','.join(devices)}" + (
        f": {'; '.join(problems[:3])}" if problems else ", bitwise equal"
    )
    return _result(name, strategy, diff, 0.0, ok, detail)


def check_format_roundtrip(
    path: str | Path, work_dir: str | Path, strategy: str = ""
) -> CheckResult:
    """(e) pt -> safetensors -> pt with ``ckpt_tools.ops.rewriting.convert``; bitwise equal.

    Args:
        path: a ``.pt`` state dict.
        work_dir: where ``<stem>.safetensors`` and ``<stem>.roundtrip.pt`` go.
        strategy: label for the result.

    Returns:
        Passed when the twice-converted file holds the same keys, dtypes, shapes and bytes.

    Example:
        >>> check_format_roundtrip("out/ddp/wrapped.pt", "out/ddp/parity").passed  # doctest: +SKIP
        True
    """
    name = "format_roundtrip"
    try:
        source, work = Path(path), Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
        middle = work / f"{source.stem}.safetensors"
        back = work / f"{source.stem}.roundtrip.pt"
        for stale in (middle, back):  # a re-run must not trip over its own old outputs
            stale.unlink(missing_ok=True)
        convert(source, middle)  # the format comes from the suffix
        convert(middle, back)
        diff, problems = compare_state_dicts(load_pt(source), load_pt(back), bitwise=True)
    except Exception as exc:  # any failure is this check's finding, not the report's end
        return _failed(name, strategy, 0.0, exc)
    ok = not problems
    detail = "pt -> safetensors -> pt " + (
        f": {'; '.join(problems[:3])}" if problems else "bitwise equal"
    )
    return _result(name, strategy, diff, 0.0, ok, detail)
