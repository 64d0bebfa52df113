"""Make small checkpoint fixtures from real harness runs of every strategy.

    python -m ckpt_tools.harness.make_fixtures fixtures/harness

writes ``<dir>/<strategy>/{wrapped,bare,trainer}.pt`` for single, dp, ddp and manual
(a tiny 784-4-10 MLP, 2 SGD steps, world size 2, on the CPU so the files do not depend on
the machine's GPUs) and a ``README.md`` saying how they were made and what they hold.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ckpt_tools.harness.config import CHECKPOINT_NAMES, RUN_JSON, STRATEGIES, TrainConfig
from ckpt_tools.harness.strategies import train

__all__ = ["FIXTURE_COMMAND", "FIXTURE_STRATEGIES", "make_fixtures"]

#: The committed set: the four data-parallel strategies (``fsdp``'s DCP folder and ``zero``'s
#: DeepSpeed folder are left out: their checkpoints are the same files, and those layouts
#: are for the DCP and DeepSpeed tests to make).
FIXTURE_STRATEGIES: tuple[str, ...] = tuple(s for s in STRATEGIES if s not in ("fsdp", "zero"))

#: The command line that regenerates ``fixtures/harness`` (recorded in its README).
FIXTURE_COMMAND = "python -m ckpt_tools.harness.make_fixtures fixtures/harness"
_WHAT = {
    "wrapped": "state dict of the wrapped model (`module.` keys)",
    "bare": "state dict of the unwrapped model",
    "trainer": '`{{"model": bare, "optimizer": SGD state, "epoch": {epoch}, "step": {step}}}`',
}


def make_fixtures(
    out_dir: str | Path,
    *,
    steps: int = 2,
    world_size: int = 2,
    hidden: Sequence[int] = (4,),
    seed: int = 0,
    strategies: Sequence[str] = FIXTURE_STRATEGIES,
) -> list[Path]:
    """Train a tiny MLP with every strategy and keep its checkpoints as fixtures.

    Args:
        out_dir: the fixture directory (created; existing fixture files are replaced).
        steps: SGD steps per strategy.
        world_size: ranks/replicas for dp, ddp and manual.
        hidden: MLP hidden widths; ``(4,)`` keeps the whole set near 220 KB.
        seed: seed of weights, data and batch order.
        strategies: which strategies to run (all four for the committed fixtures).

    Returns:
        Paths of the checkpoint files written, then the README.

    Raises:
        UsageError: bad sizes (see :func:`ckpt_tools.harness.train`).
        RuntimeError: a DDP worker failed.

    Example:
        >>> make_fixtures("fixtures/harness", steps=1, strategies=("single",))
        [PosixPath('fixtures/harness/single/wrapped.pt'), ...,
         PosixPath('fixtures/harness/README.md')]
    """
    root = Path(out_dir)
    written: list[Path] = []
    rows: list[str] = []
    losses: list[str] = []
    for strategy in strategies:
        config = TrainConfig(
            strategy=strategy,
            model="mlp",
            steps=steps,
            world_size=world_size,
            seed=seed,
            device="cpu",  # fixtures must not depend on the GPUs of the machine making them
            out_dir=str(root / strategy),
            model_kwargs={"hidden": tuple(hidden)},
        )
        result = train(config)
        # The run summary is in the README; the folder keeps only checkpoints.
        (root / strategy / RUN_JSON).unlink(missing_ok=True)
        for name in CHECKPOINT_NAMES:
            path = Path(result.checkpoints[name])
            written.append(path)
            rows.append(_row(root, path, name))
        losses.append(f"- {strategy}: " + ", ".join(f"{x:.5f}" for x in result.losses))
    readme = root / "README.md"
    text = _readme(rows, losses, steps, world_size, hidden, seed, written)
    readme.write_text(text, encoding="utf-8")
    return [*written, readme]


def _row(root: Path, path: Path, name: str) -> str:
    """One README table row: file, what it holds, number of tensors, size."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    model_sd = data["model"] if name == "trainer" else data
    what = _WHAT[name].format(**data) if name == "trainer" else _WHAT[name]
    return (
        f"| `{path.relative_to(root).as_posix()}` | {what} | {len(model_sd)} "
        f"| {path.stat().st_size} |"
    )


def _readme(
    rows: list[str],
    losses: list[str],
    steps: int,
    world_size: int,
    hidden: Sequence[int],
    seed: int,
    written: list[Path],
) -> str:
    total = sum(p.stat().st_size for p in written)
    widths = "-".join(str(w) for w in (784, *hidden, 10))
    return "\n".join(
        [
            "# Harness fixtures",
            "",
            "Checkpoints from real training runs of `ckpt_tools.harness`, one folder per",
            f"strategy: an MLP {widths}, {steps} SGD steps (lr 0.05, momentum 0.9), global",
            f"batch 32, world size {world_size}, seed {seed}, on the CPU (DDP: 2 processes over",
            "gloo; dp: DataParallel as a plain forward; manual: 2 CPU replicas).",
            "",
            "Made with:",
            "",
            f"    {FIXTURE_COMMAND}",
            "",
            "Saved with plain `torch.save` (zip format). `single` and `manual` save the",
            "wrapped layout as `nn.DataParallel(model).state_dict()` would (`module.` keys).",
            "All four strategies end at the same weights up to float32 summation order.",
            "",
            "| file | holds | model tensors | bytes |",
            "| --- | --- | --- | --- |",
            *rows,
            "",
            f"Total: {total} bytes.",
            "",
            "Loss per step (global-batch mean, before each update):",
            "",
            *losses,
            "",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckpt_tools.harness.make_fixtures DIR``; prints what it wrote."""
    parser = argparse.ArgumentParser(prog="python -m ckpt_tools.harness.make_fixtures")
    parser.add_argument("out_dir", help="fixture directory, e.g. fixtures/harness")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    paths = make_fixtures(args.out_dir, steps=args.steps, world_size=args.world_size)
    for path in paths:
        print(f"{path.stat().st_size:>8}  {path}")
    print(f"{sum(p.stat().st_size for p in paths):>8}  total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
