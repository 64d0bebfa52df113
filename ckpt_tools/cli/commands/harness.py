"""``ckpt harness train|parity``: the training harness and the checkpoint parity report.

The one command line of the harness: ``python -m ckpt_tools.harness`` (what ``torchrun``
starts per rank) runs this same group. Usage errors from the harness are
:class:`ckpt_tools.errors.UsageError` and reach the error boundary of
:func:`ckpt_tools.cli.main.run_command` (exit 2) unchanged. ``parity`` exits 1 when a
check fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import click
from tabulate import tabulate

# config.py is torch-free: `ckpt --help` and the choices below do not import torch.
from ckpt_tools.cli.main import leave_at_exit
from ckpt_tools.cli.render import echo_json
from ckpt_tools.harness.config import (
    MODEL_NAMES,
    STRATEGIES,
    ZERO_STAGES,
    TrainConfig,
    torchrun_env,
)
from ckpt_tools.loading.extras import require_torch

if TYPE_CHECKING:
    from ckpt_tools.harness.config import TrainResult
    from ckpt_tools.harness.parity.checks import CheckResult
    from ckpt_tools.harness.parity.run import ParityReport

__all__ = ["CHECK_HEADERS", "RunOptions", "harness"]

#: Column headers of the parity table, one per check of ``harness.checks.CHECK_NAMES``.
CHECK_HEADERS = {
    "strip_prefix": "(a) strip_prefix",
    "add_prefix": "(b) add_prefix",
    "vs_single": "(c) vs single",
    "device_roundtrip": "(d) device",
    "format_roundtrip": "(e) format",
    "dcp_roundtrip": "(f) dcp",
    "zero_roundtrip": "(g) zero",
}
#: The checks only some strategies' runs have (a column when a row has one).
_EXTRA_CHECKS = ("dcp_roundtrip", "zero_roundtrip")
_DEFAULT_ARCH = "mlp"


@dataclass(frozen=True)
class RunOptions:
    """The options ``train`` and ``parity`` share, named as :class:`TrainConfig` names them."""

    model: str
    steps: int
    world_size: int | None
    batch_size: int
    seed: int
    gpus: str | None
    device: str | None
    zero_stage: int


def _arch(arch: str | None, deprecated_model: str | None) -> str:
    """The model name from ``--arch``, or from the deprecated ``--model`` alias."""
    if deprecated_model is None:
        return arch or _DEFAULT_ARCH
    click.echo("warning: --model is deprecated in `ckpt harness`; use --arch", err=True)
    if arch is not None and arch != deprecated_model:
        raise click.BadParameter(
            f"--arch {arch} and --model {deprecated_model} disagree; pass only --arch",
            param_hint="--arch",
        )
    return deprecated_model


_OPTIONS = [
    click.option(
        "--arch",
        type=click.Choice(MODEL_NAMES),
        default=None,
        help=f"Model architecture.  [default: {_DEFAULT_ARCH}]",
    ),
    # `--model` is a MODULE:FACTORY spec in `ckpt diff`; here it was the architecture.
    click.option("--model", "deprecated_model", type=click.Choice(MODEL_NAMES), hidden=True),
    click.option(
        "--steps",
        type=click.IntRange(min=1),
        default=5,
        show_default=True,
        help="Optimizer steps, one batch each.",
    ),
    click.option(
        "--world-size",
        type=click.IntRange(min=1),
        default=None,
        help="Ranks/replicas (default: one per GPU; 2 on the CPU; torchrun's under torchrun).",
    ),
    click.option(
        "--batch-size",
        type=click.IntRange(min=1),
        default=32,
        show_default=True,
        help="Global batch, split over the ranks.",
    ),
    click.option(
        "--seed",
        type=int,
        default=0,
        show_default=True,
        help="Seeds the initial weights, the synthetic data and its order.",
    ),
    click.option("--gpus", default=None, help="'0,3', or 'auto:2' for the 2 freest GPUs."),
    click.option(
        "--device",
        type=click.Choice(["cpu", "cuda"]),
        default=None,
        help="Force the CPU (or insist on GPUs).",
    ),
    click.option(
        "--zero-stage",
        type=click.Choice([str(stage) for stage in ZERO_STAGES]),
        default="3",
        show_default=True,
        help="ZeRO stage of the zero strategy (DeepSpeed): 1 partitions the optimizer states, "
        "2 also the gradients, 3 also the parameters.",
    ),
    click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables."),
]


def _run_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Add the shared options; the command receives them as one ``run: RunOptions``."""

    @functools.wraps(f)
    def command(*args: Any, arch: str | None, deprecated_model: str | None, **kw: Any) -> Any:
        shared = {name: kw.pop(name) for name in ("steps", "world_size", "batch_size", "seed")}
        shared.update(gpus=kw.pop("gpus"), device=kw.pop("device"))
        shared["zero_stage"] = int(kw.pop("zero_stage"))
        run = RunOptions(model=_arch(arch, deprecated_model), **shared)
        return f(*args, run=run, **kw)

    for option in reversed(_OPTIONS):
        command = option(command)
    return command


# The same help options under `ckpt` and as `python -m ckpt_tools.harness` (no parent there).
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def harness() -> None:
    """Train small models single/dp/ddp/manual/fsdp/zero and check checkpoint parity.

    Without a GPU everything runs on the CPU: DDP, FSDP2 and DeepSpeed ZeRO as CPU
    processes over gloo, the manual loop over CPU replicas, DataParallel as a plain
    forward. fsdp also saves a DCP folder (dcp/), zero a DeepSpeed folder (deepspeed/; zero
    needs pip install 'ckpt_tools[deepspeed]'). Under torchrun, each rank runs `train
    --strategy ddp` (or fsdp, zero) and only rank 0 prints.
    """


@harness.command("train")
@click.option("--strategy", type=click.Choice(STRATEGIES), required=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Directory for wrapped.pt, bare.pt, trainer.pt and run.json (default: keep none).",
)
@click.option(
    "--lr",
    type=float,
    default=0.05,
    show_default=True,
    help="The learning rate of SGD (with momentum).",
)
@_run_options
def train_cmd(
    strategy: str, out_dir: str | None, lr: float, run: RunOptions, as_json: bool
) -> None:
    """Train with one strategy and, with --out, save its checkpoints there."""
    require_torch("ckpt harness train")
    from ckpt_tools.harness.strategies import train

    env = torchrun_env()
    if env is not None:
        leave_at_exit()  # gloo's threads can abort the interpreter's exit, failed or not
    result = train(TrainConfig(strategy=strategy, lr=lr, out_dir=out_dir, **asdict(run)))
    if env is None or env.rank == 0:  # under torchrun every rank returns; one reports
        _echo_train(result, as_json)


def _echo_train(result: TrainResult, as_json: bool) -> None:
    if as_json:
        echo_json(result.to_json())
        return
    backend = f", {result.backend}" if result.backend else ""
    click.echo(
        f"{result.strategy} on {','.join(result.devices)} (world size {result.world_size}, "
        f"{result.launcher}{backend}) in {result.seconds:.1f}s"
    )
    if result.fallback:
        click.echo(f"fallback: {result.fallback}")
    rows = [(i + 1, f"{loss:.6f}") for i, loss in enumerate(result.losses)]
    click.echo(tabulate(rows, headers=["step", "loss"]))
    for name, path in result.checkpoints.items():
        click.echo(f"{name}: {path}")


def _cell(row: CheckResult) -> str:
    """One table cell: the max abs diff and what it means."""
    if row.status == "baseline":
        return row.status
    diff = f"{row.max_abs_diff:.3g}"
    return {"pass": f"{diff} ok", "fail": f"{diff} FAIL"}.get(row.status, f"{diff} ({row.status})")


@harness.command("parity")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Keep the checkpoints in OUT/<strategy>/ (default: a temporary directory).",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Draw each strategy's loss and weight difference from single-device training per "
    "step into this image (needs matplotlib).",
)
@click.option(
    "--strategies",
    default=",".join(STRATEGIES),
    show_default=True,
    help="Comma-separated strategies to run; single (the baseline) always runs.",
)
@_run_options
@click.pass_context
def parity_cmd(
    ctx: click.Context,
    out_dir: str | None,
    plot_path: str | None,
    strategies: str,
    run: RunOptions,
    as_json: bool,
) -> None:
    """Train every strategy with one seed and batch; check that checkpoints agree.

    Exits 0 when every parity check holds, 1 otherwise.
    """
    require_torch("ckpt harness parity")
    from ckpt_tools.harness.parity.plot import check_plot_path, plot_parity
    from ckpt_tools.harness.parity.run import run_parity

    if plot_path is not None:
        check_plot_path(plot_path)  # before the training, not after it
    report = run_parity(
        out_dir=out_dir,
        strategies=[part.strip() for part in strategies.split(",") if part.strip()],
        **asdict(run),
    )
    from ckpt_tools.errors import UsageError

    plot_error: OSError | UsageError | None = None
    if plot_path is not None:
        title = f"{run.model}: parity with single-device training, {run.steps} steps"
        try:
            plot_parity(
                report.losses,
                report.weight_gaps,
                plot_path,
                tolerance=report.tolerance,
                title=title,
            )
        except (OSError, UsageError) as exc:  # its folder changed since the check: keep the report
            plot_error, plot_path = exc, None
    if as_json:
        echo_json(report.to_json())
    else:
        _echo_parity(report, plot_path)
    if plot_error is not None:
        raise plot_error
    if not report.all_passed:
        # ctx.exit works both behind run_command (which maps Exit to its code) and as a
        # standalone click command.
        ctx.exit(1)


def _has(report: ParityReport, strategy: str, check: str) -> bool:
    return any(r.strategy == strategy and r.name == check for r in report.rows)


def _extra_checks(report: ParityReport) -> list[str]:
    """The checks of :data:`_EXTRA_CHECKS` that some row of the report has."""
    return [c for c in _EXTRA_CHECKS if any(r.name == c for r in report.rows)]


def _echo_parity(report: ParityReport, plot_path: str | None) -> None:
    """The parity table, what it means, fallbacks, failures and the verdict."""
    from ckpt_tools.harness.parity.checks import CHECK_NAMES

    # (f) only for runs that saved a DCP folder (fsdp), (g) a DeepSpeed one (zero).
    extra = _extra_checks(report)
    names = [*CHECK_NAMES, *extra]
    table = [
        [run.strategy, ",".join(run.devices)]
        + [
            _cell(report.row(run.strategy, check)) if _has(report, run.strategy, check) else "-"
            for check in names
        ]
        for run in report.runs
    ]
    headers = ["strategy", "devices", *(CHECK_HEADERS[c] for c in names)]
    click.echo(tabulate(table, headers=headers))
    bitwise = "(a)(b)(d)(e)" + "".join(CHECK_HEADERS[c].split()[0] for c in extra)
    click.echo(
        f"max abs diffs; {bitwise} must be bitwise equal, (c) within "
        f"{report.tolerance:g} of single-device weights after {report.steps} steps"
    )
    for run in report.runs:
        if run.fallback:
            click.echo(f"{run.strategy}: {run.fallback}")
    for row in report.rows:
        if row.status not in ("pass", "baseline"):
            click.echo(f"{row.strategy} {row.name} {row.status}: {row.detail}")
    if plot_path is not None:
        click.echo(f"parity plot (loss, weight difference per step): {plot_path}")
    click.echo("parity holds" if report.all_passed else "parity FAILED")
