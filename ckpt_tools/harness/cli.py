"""Process entry point of the harness: ``python -m ckpt_tools.harness train|parity ...``.

This is what ``torchrun`` starts, once per rank::

    torchrun --standalone --nproc-per-node 2 -m ckpt_tools.harness train \\
        --strategy ddp --model mlp --steps 5 --out DIR

Each rank runs the same DDP worker as the internally spawned ones, joining with env://
rendezvous. Being the process entry, this module may print; only rank 0 does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ckpt_tools.errors import UsageError
from ckpt_tools.harness.config import STRATEGIES, TrainConfig, TrainResult
from ckpt_tools.harness.models import MODEL_NAMES

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m ckpt_tools.harness``."""
    parser = argparse.ArgumentParser(
        prog="python -m ckpt_tools.harness",
        description="Train small models with single/dp/ddp/manual and check checkpoint parity.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="mlp", choices=MODEL_NAMES)
        p.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
        p.add_argument(
            "--world-size",
            type=int,
            default=None,
            help="ranks/replicas (default: number of GPUs, 2 on CPU; torchrun's under torchrun)",
        )
        p.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--gpus", default=None, help="'0,3', 'auto:2' (freest), default all")
        p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="force a device")
        p.add_argument("--json", action="store_true", help="print the result as JSON")

    train_p = sub.add_parser("train", help="train one strategy and save its checkpoints")
    train_p.add_argument("--strategy", required=True, choices=STRATEGIES)
    train_p.add_argument("--out", default=None, help="directory for wrapped/bare/trainer.pt")
    train_p.add_argument("--lr", type=float, default=0.05)
    common(train_p)

    parity_p = sub.add_parser("parity", help="train every strategy and run the parity checks")
    parity_p.add_argument("--out", default=None, help="keep checkpoints in OUT/<strategy>/")
    parity_p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="comma-separated strategies; single (the baseline) always runs",
    )
    common(parity_p)
    return parser


def _print_train(result: TrainResult, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    line = (
        f"strategy={result.strategy} model={result.model} world_size={result.world_size} "
        f"devices={','.join(result.devices)} launcher={result.launcher}"
    )
    print(line + (f" backend={result.backend}" if result.backend else ""))
    if result.fallback:
        print(f"fallback: {result.fallback}")
    print("losses: " + " ".join(f"{x:.6f}" for x in result.losses))
    for name, path in result.checkpoints.items():
        print(f"{name}: {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the harness command line.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` by default.

    Returns:
        The exit status: 0 ok, 1 parity failed, 2 usage error.
    """
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        return _parity(args)
    except UsageError as exc:
        print(f"error: {exc.render(for_cli=True)}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    from ckpt_tools.harness.ddp import torchrun_env
    from ckpt_tools.harness.strategies import train

    env = torchrun_env()
    if env is not None and args.strategy != "ddp":
        raise UsageError(
            f"torchrun started {env.world_size} processes, but --strategy {args.strategy} "
            "runs in one process: use --strategy ddp, or run without torchrun"
        )
    config = TrainConfig(
        strategy=args.strategy,
        model=args.model,
        steps=args.steps,
        world_size=args.world_size,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        gpus=args.gpus,
        device=args.device,
        out_dir=args.out,
    )
    result = train(config)
    if env is None or env.rank == 0:
        _print_train(result, args.json)
    return 0


def _parity(args: argparse.Namespace) -> int:
    from ckpt_tools.harness.parity import run_parity

    report = run_parity(
        world_size=args.world_size if args.world_size is not None else 2,
        steps=args.steps,
        model=args.model,
        out_dir=args.out,
        strategies=[part.strip() for part in args.strategies.split(",") if part.strip()],
        seed=args.seed,
        batch_size=args.batch_size,
        gpus=args.gpus,
        device=args.device,
    )
    if args.json:
        print(report.to_json())
    else:
        for row in report.rows:
            print(
                f"{row.strategy:7} {row.name:17} {row.status:15} "
                f"max_abs_diff={row.max_abs_diff:.3g}  {row.detail}"
            )
        print("all parity checks hold" if report.all_passed else "PARITY FAILED")
    return 0 if report.all_passed else 1
