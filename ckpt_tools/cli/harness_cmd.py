"""``ckpt harness train|parity``: the training harness and the checkpoint parity report.

Usage errors from the harness are :class:`ckpt_tools.errors.UsageError` and reach
``ckpt``'s error boundary (exit 2) unchanged. ``parity`` exits 1 when a check fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
from tabulate import tabulate

if TYPE_CHECKING:
    from ckpt_tools.harness.checks import CheckResult

__all__ = ["harness"]

# Literal copies so that `ckpt --help` does not import torch through the harness;
# tests/harness checks that they match ckpt_tools.harness.
_STRATEGIES = ("single", "dp", "ddp", "manual")
_MODELS = ("mlp", "lenet", "resnet", "resnet-syncbn")
_CHECK_HEADERS = {
    "strip_prefix": "(a) strip_prefix",
    "add_prefix": "(b) add_prefix",
    "vs_single": "(c) vs single",
    "device_roundtrip": "(d) device",
    "format_roundtrip": "(e) format",
}


_F = TypeVar("_F", bound=Callable[..., Any])


def _common(f: _F) -> _F:
    """Options ``train`` and ``parity`` share."""
    options = [
        click.option("--model", type=click.Choice(_MODELS), default="mlp", show_default=True),
        click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True),
        click.option(
            "--world-size",
            type=click.IntRange(min=1),
            default=None,
            help="Ranks/replicas (default: one per GPU; 2 on the CPU).",
        ),
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=32,
            show_default=True,
            help="Global batch, split over the ranks.",
        ),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--gpus", default=None, help="'0,3', or 'auto:2' for the 2 freest GPUs."),
        click.option(
            "--device",
            type=click.Choice(["cpu", "cuda"]),
            default=None,
            help="Force the CPU (or insist on GPUs).",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


@click.group()
def harness() -> None:
    """Train small models single/dp/ddp/manual and check checkpoint parity.

    Without a GPU everything runs on the CPU: DDP as CPU processes over gloo, the manual
    loop over CPU replicas, DataParallel as a plain forward.
    """


@harness.command("train")
@click.option("--strategy", type=click.Choice(_STRATEGIES), required=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    required=True,
    help="Directory for wrapped.pt, bare.pt, trainer.pt and run.json.",
)
@click.option("--lr", type=float, default=0.05, show_default=True)
@_common
def train_cmd(
    strategy: str,
    out_dir: str,
    lr: float,
    model: str,
    steps: int,
    world_size: int | None,
    batch_size: int,
    seed: int,
    gpus: str | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Train with one strategy and save its checkpoints into OUT."""
    import json

    from ckpt_tools.harness import TrainConfig, train

    config = TrainConfig(
        strategy=strategy,
        model=model,
        steps=steps,
        world_size=world_size,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        gpus=gpus,
        device=device,
        out_dir=out_dir,
    )
    result = train(config)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    click.echo(
        f"{result.strategy} on {','.join(result.devices)} "
        f"(world size {result.world_size}, {result.launcher}"
        + (f", {result.backend}" if result.backend else "")
        + f") in {result.seconds:.1f}s"
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
    help="Draw each strategy's loss curve into this image (needs matplotlib).",
)
@click.option(
    "--strategies",
    default=",".join(_STRATEGIES),
    show_default=True,
    help="Comma-separated strategies to run; single (the baseline) always runs.",
)
@_common
@click.pass_context
def parity_cmd(
    ctx: click.Context,
    out_dir: str | None,
    plot_path: str | None,
    strategies: str,
    model: str,
    steps: int,
    world_size: int | None,
    batch_size: int,
    seed: int,
    gpus: str | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Train every strategy with one seed and batch; check that checkpoints agree.

    Exits 0 when every parity check holds, 1 otherwise.
    """
    from ckpt_tools.harness import CHECK_NAMES, run_parity
    from ckpt_tools.harness.plot import plot_losses

    report = run_parity(
        world_size=world_size if world_size is not None else 2,
        steps=steps,
        model=model,
        out_dir=out_dir,
        strategies=[part.strip() for part in strategies.split(",") if part.strip()],
        seed=seed,
        batch_size=batch_size,
        gpus=gpus,
        device=device,
    )
    if plot_path is not None:
        plot_losses(report.losses, plot_path, title=f"{model}: loss per step")
    if as_json:
        click.echo(report.to_json())
    else:
        table = [
            [run.strategy, ",".join(run.devices)]
            + [_cell(report.row(run.strategy, check)) for check in CHECK_NAMES]
            for run in report.runs
        ]
        headers = ["strategy", "devices", *(_CHECK_HEADERS[c] for c in CHECK_NAMES)]
        click.echo(tabulate(table, headers=headers))
        click.echo(
            f"max abs diffs; (a)(b)(d)(e) must be bitwise equal, (c) within "
            f"{report.tolerance:g} of single-device weights after {report.steps} steps"
        )
        for run in report.runs:
            if run.fallback:
                click.echo(f"{run.strategy}: {run.fallback}")
        for row in report.rows:
            if row.status not in ("pass", "baseline"):
                click.echo(f"{row.strategy} {row.name} {row.status}: {row.detail}")
        if plot_path is not None:
            click.echo(f"loss curves: {plot_path}")
        click.echo("parity holds" if report.all_passed else "parity FAILED")
    if not report.all_passed:
        # ctx.exit works both under ckpt's main() (which maps Exit to its code) and as a
        # standalone click command.
        ctx.exit(1)
