"""DeepSpeed ZeRO checkpoints made by real training, on CPU processes (gloo) or GPUs.

The harness's ``zero`` strategy is :mod:`ckpt_tools.harness.zero.strategy`; this module makes
the checkpoints the DeepSpeed tests read.

:mod:`ckpt_tools.harness.zero.launch` starts ``world_size`` ranks under ``torchrun`` and each
rank runs :func:`main`: one process group for every run it is given, and for each run a fresh
:class:`ZeroNet` trained for a few steps by a DeepSpeed engine at the run's ZeRO stage and
dtype, then saved with ``engine.save_checkpoint`` into ``out/<run name>/``; rank 0 may then
save DeepSpeed's own ``zero_to_fp32`` state dict of each saved tag (:func:`reference_path`),
the oracle a consolidation is compared with. Running several runs in one launch pays for
the interpreters and DeepSpeed's import once.

The model holds what a ZeRO checkpoint must carry besides plain weights: a frozen
parameter, a tied (shared) parameter and BatchNorm buffers (float and integer).

On the CPU, DeepSpeed's shared-memory communication op is turned off before the process
group starts (it would be compiled on first use, which needs a compiler), fp16 is let
through the accelerator's check (DeepSpeed's CPU accelerator refuses it, yet trains and
saves it), and each rank leaves with ``os._exit`` once the process group is gone: DeepSpeed's
threads can abort the interpreter's own exit after a complete save.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ckpt_tools._types import one_of
from ckpt_tools.errors import UsageError

__all__ = [
    "ZERO_DTYPES",
    "ZeroNet",
    "ZeroRun",
    "deepspeed_config",
    "main",
    "reference_path",
    "zero_to_fp32",
]

#: Training dtypes a run may ask for.
ZERO_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")

#: Vocabulary and width of :class:`ZeroNet`: odd sizes, so that no parameter splits evenly
#: over the ranks and every rank's partition needs padding.
VOCAB, WIDTH = 13, 7


@dataclass(frozen=True)
class ZeroRun:
    """One DeepSpeed training run and its checkpoint.

    Attributes:
        name: the folder under the output directory that ``save_checkpoint`` writes to.
        stage: the ZeRO stage (0 to 3).
        dtype: ``fp32``, ``bf16`` or ``fp16`` training.
        steps: optimizer steps before the save.
        tag: the checkpoint's tag (None: DeepSpeed's ``global_step{N}``).
        sub_group_size: ZeRO-3's flat sub-group size in elements (small values split the
            fp32 partition of every rank into several flat groups).
        parameter_alignment: stage 1/2's per-parameter alignment padding.
        saves: how many of the last steps end with a save (each under its own tag, so
            ``saves=2`` leaves an older tag beside the one ``latest`` names).
        seed: seeds the weights and the batches.
        width: :class:`ZeroNet`'s width (its parameters grow with its square: 4096 gives
            about 67M, 268 MB in fp32).
        fp32_grads: accumulate 16-bit gradients in fp32 (``data_types.grad_accum_dtype``):
            with bf16 at stage 1, DeepSpeed then trains with its separate bf16 optimizer.
    """

    name: str
    stage: int
    dtype: str = "fp32"
    steps: int = 2
    tag: str | None = None
    sub_group_size: int | None = None
    parameter_alignment: bool = False
    saves: int = 1
    seed: int = 0
    width: int = WIDTH
    fp32_grads: bool = False

    @property
    def zero_to_fp32_reads(self) -> bool:
        """Whether DeepSpeed's ``zero_to_fp32`` reads this run's checkpoint: it refuses
        ZeRO-0 and the bf16 optimizer's files (bf16 at stage 1 with fp32 gradients).

        Example:
            >>> ZeroRun("r", stage=0).zero_to_fp32_reads, ZeroRun("r", stage=3).zero_to_fp32_reads
            (False, True)
        """
        bf16_optimizer = self.stage == 1 and self.dtype == "bf16" and self.fp32_grads
        return self.stage > 0 and not bf16_optimizer

    def validate(self) -> None:
        """Check the run's arguments.

        Raises:
            UsageError: an unknown stage or dtype, or no steps.

        Example:
            >>> ZeroRun("r", stage=4).validate()
            Traceback (most recent call last):
            ...
            ckpt_tools.errors.UsageError: stage=4: ZeRO has stages 0 to 3
        """
        if self.stage not in (0, 1, 2, 3):
            raise UsageError("ZeRO has stages 0 to 3", argument="stage", value=self.stage)
        one_of(self.dtype, ZERO_DTYPES, "dtype")
        if self.steps < 1:
            raise UsageError("must be at least 1", argument="steps", value=self.steps)
        if not 1 <= self.saves <= self.steps or (self.tag is not None and self.saves > 1):
            raise UsageError(
                "must be between 1 and steps (1 with a tag)", argument="saves", value=self.saves
            )


class ZeroNet(nn.Module):
    """A small token model: embedding, BatchNorm, a frozen projection, a tied output head.

    ``head.weight`` is ``embed.weight`` (tied), ``frozen`` never trains, and ``norm`` has
    float running statistics and an integer ``num_batches_tracked``.

    Args:
        width: the embedding's width; the hidden layer is ``2 * width + 1`` wide.
    """

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.norm = nn.BatchNorm1d(width)
        self.hidden = nn.Linear(width, 2 * width + 1)
        self.frozen = nn.Linear(2 * width + 1, width)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.norm(self.embed(tokens))
        x = self.frozen(torch.relu(self.hidden(x)))
        return self.head(x)


def deepspeed_config(run: ZeroRun, batch_size: int) -> dict[str, Any]:
    """The DeepSpeed config of ``run`` for a global batch of ``batch_size``.

    Args:
        run: the run.
        batch_size: the global batch (``train_batch_size``), over every rank.

    Returns:
        The config dict ``deepspeed.initialize`` takes.

    Example:
        >>> deepspeed_config(ZeroRun("r", stage=2, dtype="bf16"), 8)["bf16"]
        {'enabled': True}
    """
    zero: dict[str, Any] = {"stage": run.stage}
    if run.stage == 3 and run.sub_group_size is not None:
        zero["sub_group_size"] = run.sub_group_size
    config: dict[str, Any] = {
        "train_batch_size": batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if run.parameter_alignment:
        config["zero_optimization"]["parameter_alignment"] = True
    if run.dtype != "fp32":
        # 16-bit training casts parameters, not buffers: BatchNorm's would stay fp32.
        config["data_types"] = {"buffer_dtype": run.dtype}
        config[run.dtype] = {"enabled": True}
    if run.dtype == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    if run.fp32_grads:
        config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    return config


def _train_and_save(run: ZeroRun, out: Path, rank: int, world: int) -> list[str]:
    """One run on this rank: a fresh engine, ``run.steps`` steps, the saves (collective).

    Returns the tags saved, oldest first.
    """
    import deepspeed

    torch.manual_seed(run.seed)
    model = ZeroNet(run.width)
    batch = 4 * world
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(run, batch),
    )
    generator = torch.Generator().manual_seed(run.seed + 1)
    tags = []
    for step in range(1, run.steps + 1):
        tokens = torch.randint(0, VOCAB, (batch,), generator=generator)
        mine = tokens[rank * 4 : (rank + 1) * 4].to(engine.device)
        loss = nn.functional.cross_entropy(engine(mine).float(), mine)
        engine.backward(loss)
        engine.step()
        if step > run.steps - run.saves:
            tag = run.tag or f"global_step{step}"
            engine.save_checkpoint(str(out / run.name), tag=tag)
            tags.append(tag)
    engine.destroy()
    return tags


def _allow_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 by its own check, yet trains and saves it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        type(accelerator).is_fp16_supported = lambda self: True


def reference_path(out: str | os.PathLike[str], name: str, tag: str) -> Path:
    """Where :func:`main` saves ``zero_to_fp32``'s state dict of run ``name``'s ``tag``.

    Args:
        out: the folder of the launch's save folders.
        name: the run's name.
        tag: the saved tag.

    Returns:
        ``out/<name>-<tag>.zero_to_fp32.pt``.

    Example:
        >>> str(reference_path("o", "s2", "global_step2"))
        'o/s2-global_step2.zero_to_fp32.pt'
    """
    return Path(out) / f"{name}-{tag}.zero_to_fp32.pt"


def _save_references(out: Path, name: str, tags: Sequence[str]) -> None:
    """DeepSpeed's own consolidation of every saved tag, as ``torch.save`` files."""
    for tag in tags:
        torch.save(zero_to_fp32(out / name, tag=tag), reference_path(out, name, tag))


def zero_to_fp32(folder: str | os.PathLike[str], tag: str | None = None) -> dict[str, Any]:
    """DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` of ``folder``, whatever its name.

    DeepSpeed finds the rank files with ``glob``, so a folder named ``run[lr=0.1]`` would
    match nothing: such a folder is read through a link of a plain name.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    path = os.path.abspath(folder)
    if glob.escape(path) == path:
        return get_fp32_state_dict_from_zero_checkpoint(path, tag=tag)
    with tempfile.TemporaryDirectory() as plain:
        link = os.path.join(plain, "checkpoint")
        os.symlink(path, link)
        return get_fp32_state_dict_from_zero_checkpoint(link, tag=tag)


def main(argv: Sequence[str]) -> None:
    """One rank's work under torchrun.

    Args:
        argv: ``[out_dir, runs_json, references]``: the folder, the runs as a JSON list of
            :class:`ZeroRun` fields, and ``"1"`` to save the references.

    Trains and saves every run in turn; with ``references`` = ``"1"``, rank 0 then saves
    ``zero_to_fp32``'s state dict of each saved tag (:func:`reference_path`) of the runs it
    reads. Leaves the process with ``os._exit``.
    """
    out, runs = Path(argv[0]), [ZeroRun(**r) for r in json.loads(argv[1])]
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # Off before the process group starts: it would be compiled (c++, ninja) on first use.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    _allow_cpu_fp16()
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {run.name: _train_and_save(run, out, rank, world) for run in runs}
    dist.barrier()
    if rank == 0 and argv[2:] == ["1"]:
        for run in runs:
            if run.zero_to_fp32_reads:
                _save_references(out, run.name, saved[run.name])
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
