"""The ``zero`` strategy: DeepSpeed ZeRO (stage 1, 2 or 3), one process per device.

Launched as ``ddp`` is (:func:`ckpt_tools.harness.ddp.launch`: spawned here, or as one rank
under ``torchrun``; gloo on the CPU, with ``DS_ACCELERATOR=cpu`` and DeepSpeed's shared-memory
op off, nccl on GPUs): the harness model and its SGD optimizer trained by a DeepSpeed engine
at ``config.zero_stage``, each rank on its slice of the global batch with the loss scaled as
for DDP, so ZeRO's averaged gradients are the global batch's and ZeRO(N) matches one device
up to summation order. Every rank then takes part in ``engine.save_checkpoint`` into
``out_dir/deepspeed/``, and rank 0 writes ``bare.pt`` as ``ckpt consolidate`` writes that
folder (torch-free), ``wrapped.pt`` (its keys with ``module.``) and ``zero_to_fp32.pt``,
DeepSpeed's own consolidation of the same folder. The optimizer state stays in the DeepSpeed
folder: a ``zero`` run writes no ``trainer.pt``.

DeepSpeed's threads can abort the interpreter's own exit after a complete run, so the
launchers end a ``zero`` rank with ``os._exit`` once everything is written (see
:func:`ckpt_tools.harness.ddp.launch` and ``ckpt harness train``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_tools.errors import MissingExtraError
from ckpt_tools.harness import loop
from ckpt_tools.harness.config import DEEPSPEED_DIR, STEPS_DIR, TrainConfig, TrainResult
from ckpt_tools.harness.data import shard
from ckpt_tools.harness.zero.runs import zero_to_fp32

__all__ = ["ZERO_TO_FP32", "train_rank", "train_zero", "zero_missing"]

#: The file of a ``zero`` run's ``out_dir`` that holds ``zero_to_fp32``'s state dict.
ZERO_TO_FP32 = "zero_to_fp32.pt"


def zero_missing() -> str | None:
    """Why the ``zero`` strategy cannot run here, or None when DeepSpeed is installed.

    Looked up without importing DeepSpeed (its import is slow and picks an accelerator).

    Returns:
        ``"the zero strategy needs deepspeed: pip install 'ckpt_tools[deepspeed]'"``, or None.

    Example:
        >>> zero_missing() in (None, str(MissingExtraError("the zero strategy", "deepspeed",
        ...                                                "deepspeed")))
        True
    """
    if importlib.util.find_spec("deepspeed") is not None:
        return None
    return str(MissingExtraError("the zero strategy", "deepspeed", "deepspeed"))


def train_zero(config: TrainConfig) -> TrainResult:
    """Train with DeepSpeed ZeRO at ``config.zero_stage``, spawning the ranks or, under
    torchrun, acting as one of them (see the module docstring).

    Args:
        config: the run; ``strategy`` is taken to be ``zero``.

    Returns:
        Spawned: rank 0's result. Under torchrun: this rank's result. With ``out_dir``,
        ``checkpoints`` names ``wrapped``, ``bare``, ``deepspeed`` (the folder) and
        ``zero_to_fp32``.

    Raises:
        MissingExtraError: DeepSpeed is not installed (a UsageError).
        UsageError: as :func:`ckpt_tools.harness.ddp.train_ddp`.
        RankFailedError: a spawned rank failed or was killed (see
            :func:`ckpt_tools.harness.ddp.train_ddp`).
        RuntimeError: a spawned rank met a bug of the harness (its traceback included).

    Example:
        >>> config = TrainConfig(strategy="zero", zero_stage=2, steps=2, out_dir="o")
        >>> sorted(train_zero(config).checkpoints)  # doctest: +SKIP
        ['bare', 'deepspeed', 'wrapped', 'zero_to_fp32']
    """
    if zero_missing() is not None:
        raise MissingExtraError("the zero strategy", "deepspeed", "deepspeed")
    from ckpt_tools.harness.ddp import launch

    return launch(config, train_rank)


def _engine(model: nn.Module, config: TrainConfig, world: int, device: torch.device) -> Any:
    """A DeepSpeed engine over ``model`` and the harness's SGD, ZeRO at ``config.zero_stage``."""
    import deepspeed.ops

    # Off before DeepSpeed wraps the process group: it would be compiled on first use.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # The harness's own SGD (a client optimizer), recorded per step by _record_step, not
    # by its step hook: under ZeRO it steps flat partitions, not the model's parameters.
    optimizer = loop.make_optimizer(model.parameters(), replace(config, record_steps=False))
    ds_config = {
        "train_micro_batch_size_per_gpu": -(-config.batch_size // world),
        "gradient_accumulation_steps": 1,
        # DeepSpeed clips the global gradient norm at 1.0 unless told not to; no other
        # strategy clips, and the parity with one device would hold only while it stays small.
        "gradient_clipping": 0.0,
        # Small buckets: stages 1 and 2 allocate theirs whole (5e8 elements by default),
        # and the harness's models are tiny. Bucketing never changes an element's sum.
        "zero_optimization": {
            "stage": config.zero_stage,
            "reduce_bucket_size": 1 << 20,
            "allgather_bucket_size": 1 << 20,
        },
        # DeepSpeed vouches for its own optimizers only; torch's SGD steps ZeRO's flat
        # fp32 partitions elementwise, which is all ZeRO asks of an optimizer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


@torch.no_grad()
def _record_step(model: nn.Module, config: TrainConfig, step: int, rank: int) -> None:
    """Rank 0 saves the model's parameters after ``step`` as :class:`loop.StepRecorder`
    does; ZeRO-3's partitioned parameters are gathered first (every rank takes part)."""
    import deepspeed

    params = list(model.parameters())
    gather: Any = contextlib.nullcontext()
    if config.zero_stage == 3:
        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        if rank == 0:
            folder = Path(str(config.out_dir)) / STEPS_DIR
            folder.mkdir(parents=True, exist_ok=True)
            saved = [p.detach().to("cpu", copy=True) for p in params]
            loop.save_whole(saved, folder / f"{step:05d}.pt")


def _zero_steps(engine: Any, config: TrainConfig, rank: int, world: int) -> list[float]:
    """One rank's steps on its slice of each global batch; the global-batch loss of each."""
    import torch.distributed as dist

    losses: list[float] = []
    with loop.deterministic():
        for step, (images, labels) in enumerate(loop.global_batches(config), start=1):
            x = shard(images, rank, world).to(engine.device)
            y = shard(labels, rank, world).to(engine.device)
            # Scaled as for DDP: ZeRO averages the ranks' gradients, giving the global one.
            loss = loop.local_loss(engine(x), y, len(labels), world)
            engine.backward(loss)
            engine.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            losses.append(float(logged) / world)
            if config.record_steps and config.out_dir is not None:
                _record_step(engine.module, config, step, rank)
    return losses


def _save_checkpoint(engine: Any, folder: Path) -> None:
    """DeepSpeed's ``save_checkpoint``, a failed write said as the OSError it was: torch's
    writer (which DeepSpeed calls) raises a RuntimeError for a full disk or a file-size
    limit, which would be taken for a bug of the harness."""
    try:
        engine.save_checkpoint(str(folder))
    except RuntimeError as e:
        if "PytorchStreamWriter" not in str(e) and "inline_container" not in str(e):
            raise
        import errno
        import resource

        if os.statvfs(folder).f_bavail == 0:
            code = errno.ENOSPC
        elif resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            code = errno.EFBIG
        else:
            code = errno.EIO
        raise OSError(code, os.strerror(code), str(folder)) from e


def _save_zero(engine: Any, config: TrainConfig, rank: int) -> dict[str, str]:
    """``save_checkpoint`` (every rank), then rank 0's ``bare.pt``, ``wrapped.pt`` and
    ``zero_to_fp32.pt`` made from the folder. Returns the paths on rank 0, ``{}`` elsewhere."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ckpt_tools.ops.consolidate.consolidation import consolidate

    out = Path(str(config.out_dir))
    folder = out / DEEPSPEED_DIR
    _save_checkpoint(engine, folder)
    dist.barrier()  # every rank's files are complete before rank 0 reads them
    if rank != 0:
        return {}
    # Rank 0 cleared this run's outputs before training (ckpt_tools.harness.outputs).
    paths = {name: out / f"{name}.pt" for name in ("wrapped", "bare")}
    consolidate(folder, paths["bare"])
    bare = torch.load(paths["bare"], map_location="cpu", weights_only=True)
    loop.save_whole({f"module.{k}": v for k, v in bare.items()}, paths["wrapped"])
    # Its progress bars would take a multiprocessing lock that os._exit leaves behind
    # (the resource tracker then warns about a leaked semaphore): a thread lock does.
    tqdm.set_lock(threading.RLock())
    # Its report of what it read and its progress bars are not the harness's to print.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        reference = zero_to_fp32(folder)
    loop.save_whole(reference, out / ZERO_TO_FP32)
    return {
        **{name: str(path) for name, path in paths.items()},
        DEEPSPEED_DIR: str(folder),
        "zero_to_fp32": str(out / ZERO_TO_FP32),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's prints and log lines to stderr, its expected warnings left out.

    stdout is the command's (``ckpt harness train --json`` under torchrun prints there);
    DeepSpeed's logger takes the stream of its first import, made inside. The warnings:
    the SGD that ZeRO has not tested (asked for on purpose), and torch's deprecation of
    the collectives DeepSpeed calls.
    """
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        deprecated = "`torch.distributed.[a-z_]+` is deprecated"
        warnings.filterwarnings("ignore", deprecated, FutureWarning)
        from deepspeed.utils import logger  # made now, it writes to stderr

        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def train_rank(
    rank: int,
    world: int,
    device: torch.device,
    config: TrainConfig,
    sync_bn: bool,
    backend: str,
    launcher: str,
) -> TrainResult:
    """One rank's DeepSpeed training and its part of the saves (see the module docstring).

    Args:
        rank: this process's rank.
        world: the number of ranks.
        device: this rank's device.
        config: the run.
        sync_bn: convert BatchNorm to SyncBatchNorm.
        backend: the process group's backend, for the result.
        launcher: ``spawn`` or ``torchrun``, for the result.

    Returns:
        This rank's result (rank 0's names the files written).
    """
    from ckpt_tools.harness.ddp import rank_result

    # DeepSpeed reads the rank layout from the environment; spawned ranks have none.
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(device.index if device.type == "cuda" else rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    # Before DeepSpeed's first import in this process (in _quiet): it picks its accelerator then.
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
    model = loop.init_model(config, sync_bn=sync_bn).to(device)
    with _quiet():
        engine = _engine(model, config, world, device)
        started = time.perf_counter()
        losses = _zero_steps(engine, config, rank, world)
        seconds = time.perf_counter() - started
        checkpoints = _save_zero(engine, config, rank) if config.out_dir is not None else {}
        engine.destroy()
    what = f"{world} CPU processes over gloo, ZeRO-{config.zero_stage}"
    result = loop.finish_run(
        config,
        [device] * world,
        losses,
        model,
        model,
        engine.optimizer,
        loop.cpu_fallback([device], what),
        written=checkpoints,
    )
    return rank_result(result, device, backend, launcher, sync_bn, seconds)
