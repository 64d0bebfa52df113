"""Train every strategy with the same seed and batch, then run the parity checks on the results.

A run that saved a DCP folder (``fsdp``) also gets (f) ``dcp_roundtrip``
(:func:`ckpt_tools.harness.parity.dcp_check.check_dcp_roundtrip`), and one that saved a
DeepSpeed folder (``zero``) (g) ``zero_roundtrip``
(:func:`ckpt_tools.harness.parity.dcp_check.check_zero_roundtrip`). A ``zero`` run's
``bare.pt`` is ``ckpt consolidate``'s output of its DeepSpeed folder, so (c) compares that
with single-device training. Without DeepSpeed installed, ``zero`` is not trained: its one
row is ``skipped`` and says how to install it, and the other strategies run.

:func:`run_parity` is what ``ckpt harness parity`` and ``make demo`` run. Its
:class:`ParityReport` has one row per strategy and check, each strategy's loss curve,
its parameters' distance from single-device training's after every step (each run saves its
parameters per step, :class:`ckpt_tools.harness.loop.StepRecorder`), and ``all_passed``.

Tolerance for (c), final weights against single-device training: 1e-5 absolute for
float32. Every strategy does the same maths on the same global batch; only the order
in which per-sample gradients are summed differs (per shard, then averaged across ranks
or replicas). Each such reordering moves a float32 result by a few ulps (~1e-7 relative);
a handful of SGD steps at lr 0.05 keeps that near 1e-7, while real mistakes (a wrong
shard, a missing average, a skipped step) move weights by 1e-3 or more. 1e-5 separates the
two with two orders of margin each way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.formats.urls import refuse_url
from ckpt_tools.harness.config import (
    MULTI_PROCESS,
    STRATEGIES,
    TrainConfig,
    TrainResult,
    torchrun_env,
)
from ckpt_tools.harness.loop import init_model
from ckpt_tools.harness.models import has_batchnorm
from ckpt_tools.harness.outputs import check_outputs
from ckpt_tools.harness.parity.checks import (
    CheckResult,
    check_add_prefix,
    check_device_roundtrip,
    check_format_roundtrip,
    check_strip_prefix,
    check_vs_single,
)
from ckpt_tools.harness.parity.reference import step_gaps
from ckpt_tools.harness.placement import one_thread, resolve_devices
from ckpt_tools.harness.spawning import scratch_folder
from ckpt_tools.harness.strategies import check_replicas_batch, train
from ckpt_tools.structure.json_values import json_ready

__all__ = ["DEFAULT_TOLERANCE", "ParityReport", "run_parity"]

#: Allowed max abs weight difference against single-device training (float32).
DEFAULT_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ParityReport:
    """Strategies x checks, with loss curves and per-step weight gaps.

    Attributes:
        model: the model trained.
        world_size: ranks/replicas asked for.
        steps: SGD steps of every run.
        seed: the seed of weights, data and batch order.
        tolerance: the atol of the ``vs_single`` check.
        runs: one :class:`TrainResult` per strategy (losses, devices, fallbacks).
        rows: one :class:`CheckResult` per strategy and check.
        weight_gaps: per strategy other than ``single``, the largest absolute difference
            of its parameters from single-device training's after each step (the last one
            is (c)'s ``max_abs_diff`` for a model without buffers).
    """

    model: str
    world_size: int
    steps: int
    seed: int
    tolerance: float
    runs: tuple[TrainResult, ...]
    rows: tuple[CheckResult, ...]
    weight_gaps: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def all_passed(self) -> bool:
        """Every row passed (``not comparable`` and ``skipped`` rows count as passed)."""
        return all(row.passed for row in self.rows)

    @property
    def strategies(self) -> tuple[str, ...]:
        """The strategies, in run order."""
        return tuple(run.strategy for run in self.runs)

    @property
    def losses(self) -> dict[str, tuple[float, ...]]:
        """Each strategy's loss per step."""
        return {run.strategy: run.losses for run in self.runs}

    def row(self, strategy: str, check: str) -> CheckResult:
        """The result of ``check`` for ``strategy``.

        Raises:
            KeyError: no such row.
        """
        for row in self.rows:
            if row.strategy == strategy and row.name == check:
                return row
        raise KeyError(f"no row for strategy {strategy!r} and check {check!r}")

    def to_json(self) -> dict[str, Any]:
        """What ``--json`` prints, JSON-ready; non-finite numbers become the strings
        ``"inf"``/``"nan"``."""
        data = asdict(self)
        data["runs"] = [run.to_json() for run in self.runs]
        data["all_passed"] = self.all_passed
        data["losses"] = {k: list(v) for k, v in self.losses.items()}
        data["weight_gaps"] = {k: list(v) for k, v in self.weight_gaps.items()}
        return json_ready(data)


def _why_not_comparable(run: TrainResult, uses_bn: bool) -> str:
    """Why a run cannot match single-device weights exactly, or ``""`` when it should."""
    if not uses_bn or run.world_size == 1 or run.sync_bn:
        return ""
    return (
        f"BatchNorm statistics per replica over {run.world_size} shards vs over the whole "
        "batch on one device"
        + ("; SyncBatchNorm needs GPUs" if run.strategy in ("ddp", "fsdp", "zero") else "")
    )


def run_parity(
    world_size: int | None = 2,
    steps: int = 5,
    model: str = "mlp",
    out_dir: str | Path | None = None,
    *,
    strategies: Sequence[str] = STRATEGIES,
    seed: int = 0,
    batch_size: int = 32,
    tolerance: float = DEFAULT_TOLERANCE,
    gpus: str | tuple[int, ...] | None = None,
    device: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    zero_stage: int = 3,
) -> ParityReport:
    """Train each strategy on the same seed and global batch, then check parity.

    Args:
        world_size: ranks (DDP) / replicas (manual, dp) per strategy; ``None``: one per
            selected GPU, or 2 on the CPU, as :func:`~ckpt_tools.harness.train` counts them.
        steps: SGD steps per strategy.
        model: model name (``mlp``, ``lenet``, ``resnet``).
        out_dir: checkpoints go to ``out_dir/<strategy>/{wrapped,bare,trainer}.pt`` and
            the check files to ``out_dir/<strategy>/parity/``; ``None`` uses a temporary
            directory that is removed afterwards.
        strategies: which strategies to run; ``single`` (the baseline) always runs.
        seed: seed of weights, data and batch order.
        batch_size: the global batch.
        tolerance: atol of the ``vs_single`` check.
        gpus: GPU selection, see :func:`ckpt_tools.harness.placement.parse_gpus`.
        device: ``"cpu"`` forces the CPU.
        model_kwargs: extra model arguments.
        zero_stage: the ZeRO stage of the ``zero`` strategy.

    Returns:
        The report; ``report.all_passed`` tells whether every check held.

    Raises:
        UsageError: an unknown strategy, a run under torchrun, ``resnet-syncbn`` with a
            multi-process strategy on the CPU (before anything trains), or any
            :func:`train` usage error.
        RankFailedError: a rank of a multi-process strategy failed or was killed.
        RuntimeError: a rank met a bug of the harness.

    ``out_dir/<strategy>/`` of an earlier run keeps everything but what this run writes
    there, which is removed first (:func:`~ckpt_tools.harness.outputs.clear_outputs`).

    Example:
        >>> report = run_parity(2, steps=2, strategies=("single", "manual"), device="cpu")
        >>> report.all_passed, report.row("manual", "vs_single").max_abs_diff < 1e-5
        (True, True)
    """
    if out_dir is not None:
        refuse_url(out_dir, output=True)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UsageError(
            f"unknown strategies {', '.join(unknown)}; expected some of {', '.join(STRATEGIES)}",
            argument="strategies",
            value=repr(tuple(strategies)),
            flag="--strategies",
        )
    env = torchrun_env()
    if env is not None:
        # Each strategy's run starts its own processes; as one of torchrun's ranks, the
        # single-process baseline would train alone in every rank.
        raise UsageError(
            f"parity starts every strategy's processes itself, but torchrun started "
            f"{env.world_size}",
            remedies=(Remedy(text="run it without torchrun"),),
        )
    devices = resolve_devices(world_size, gpus, device)
    world_size = len(devices)
    order = ["single", *(s for s in STRATEGIES if s in strategies and s != "single")]
    skipped = _skipped(order)
    order = [s for s in order if s not in {row.strategy for row in skipped}]
    _refuse_sync_bn_on_cpu(model, order, devices[0].type)
    kw = dict(model_kwargs or {})
    with scratch_folder("ckpt-harness-parity-") as scratch:
        root = Path(out_dir) if out_dir is not None else Path(scratch)
        common = dict(model=model, steps=steps, world_size=world_size, batch_size=batch_size)
        common.update(seed=seed, gpus=gpus, device=device, model_kwargs=kw, zero_stage=zero_stage)
        configs = _checked_configs(order, root, devices, common)
        with one_thread():  # the ranks' one thread: the same kernels, so the same sums
            runs = [train(config) for config in configs]
        uses_bn = has_batchnorm(init_model(TrainConfig(model=model, model_kwargs=kw)))
        rows: list[CheckResult] = list(skipped)
        single_bare = root / "single" / "bare.pt"
        for run in runs:
            rows += _check_run(run, root / run.strategy, single_bare, model, kw, tolerance, uses_bn)
        gaps = {
            run.strategy: step_gaps(root / run.strategy, root / "single")
            for run in runs
            if run.strategy != "single"
        }
        if out_dir is None:
            # The files are about to go with the scratch directory: do not point at them.
            runs = [replace(run, out_dir=None, checkpoints={}) for run in runs]
    return ParityReport(
        model, world_size, steps, seed, tolerance, tuple(runs), tuple(rows), weight_gaps=gaps
    )


def _checked_configs(
    order: Sequence[str], root: Path, devices: Sequence[Any], common: Mapping[str, Any]
) -> list[TrainConfig]:
    """Each strategy's run, every one checked (sizes, outputs) before the first one trains:
    a refusal of the last must not come after the others have trained."""
    configs = [
        TrainConfig(strategy=s, out_dir=str(root / s), record_steps=True, **common) for s in order
    ]
    for config in configs:
        config.validate()
        check_replicas_batch(config, devices)
        check_outputs(root / config.strategy, config.strategy, record_steps=True)
    return configs


def _refuse_sync_bn_on_cpu(model: str, order: Sequence[str], device_type: str) -> None:
    """Refuse, before anything trains, the ranks that would need SyncBatchNorm on the CPU.

    ``resnet-syncbn`` converts BatchNorm to SyncBatchNorm in every multi-process strategy,
    and torch implements it for CUDA only; the one-process strategies train it as is.
    """
    needs_gpu = [s for s in order if s in MULTI_PROCESS]
    if model.lower() != "resnet-syncbn" or device_type != "cpu" or not needs_gpu:
        return
    others = tuple(s for s in order if s not in MULTI_PROCESS)
    raise UsageError(
        f"SyncBatchNorm needs GPUs (torch implements it for CUDA only), but "
        f"{', '.join(needs_gpu)} would run it on the CPU",
        argument="model",
        value=repr(model),
        flag="--arch",
        remedies=(
            Remedy("strategies", repr(others), flag=f"--strategies {','.join(others)}"),
            Remedy("model", "'resnet'", flag="--arch resnet", text="(BatchNorm per rank)"),
            Remedy(text="run on GPUs"),
        ),
    )


def _skipped(order: Sequence[str]) -> list[CheckResult]:
    """One ``skipped`` row per strategy that cannot run here: ``zero`` without DeepSpeed,
    ``fsdp`` on a torch without FSDP2."""
    rows = []
    if "zero" in order:
        from ckpt_tools.harness.zero.strategy import zero_missing

        rows.append(("zero", zero_missing()))
    if "fsdp" in order:
        from ckpt_tools.harness.fsdp import fsdp_missing

        rows.append(("fsdp", fsdp_missing()))
    return [
        CheckResult("vs_single", True, math.nan, None, why, strategy, "skipped")
        for strategy, why in rows
        if why is not None
    ]


def _check_run(
    run: TrainResult,
    run_dir: Path,
    single_bare: Path,
    model: str,
    model_kwargs: Mapping[str, Any],
    tolerance: float,
    uses_bn: bool,
) -> list[CheckResult]:
    """The five checks on one strategy's checkpoints, in :data:`CHECK_NAMES` order, then
    ``dcp_roundtrip`` for a run that saved a DCP folder (``fsdp``) and ``zero_roundtrip``
    for one that saved a DeepSpeed folder (``zero``)."""
    wrapped, bare, work = run_dir / "wrapped.pt", run_dir / "bare.pt", run_dir / "parity"
    why_not = _why_not_comparable(run, uses_bn)
    rows = [
        check_strip_prefix(wrapped, model, model_kwargs, run.strategy, bare),
        check_add_prefix(bare, model, model_kwargs, run.strategy),
        check_vs_single(bare, single_bare, tolerance, run.strategy, not why_not, why_not),
        check_device_roundtrip(wrapped, work, run.strategy),
        check_format_roundtrip(wrapped, work, run.strategy),
    ]
    dcp = run.checkpoints.get("dcp")
    if dcp is not None:
        from ckpt_tools.harness.parity.dcp_check import check_dcp_roundtrip

        rows.append(
            check_dcp_roundtrip(
                dcp,
                bare,
                model=model,
                model_kwargs=model_kwargs,
                work_dir=work,
                strategy=run.strategy,
            )
        )
    deepspeed = run.checkpoints.get("deepspeed")
    if deepspeed is not None:
        from ckpt_tools.harness.parity.dcp_check import check_zero_roundtrip

        reference = run.checkpoints["zero_to_fp32"]
        rows.append(
            check_zero_roundtrip(
                deepspeed, reference, model=model, model_kwargs=model_kwargs, work_dir=work
            )
        )
    if run.strategy != "single" and rows[2].status == "pass" and run.losses:
        baseline = TrainResult.read_json(single_bare.parent).losses
        gap = max(abs(a - b) for a, b in zip(run.losses, baseline, strict=False))
        rows[2] = replace(rows[2], detail=f"{rows[2].detail}; loss curves differ by {gap:.2g}")
    return rows
