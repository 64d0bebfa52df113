"""The ``ddp`` strategy: DistributedDataParallel, one process per device.

The same worker code runs whichever way the processes were started:

* internally: :func:`train_ddp` finds a free port on 127.0.0.1 and starts ``world_size``
  processes with ``torch.multiprocessing.spawn`` (tcp:// rendezvous);
* externally: under ``torchrun`` (detected from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
  ``MASTER_ADDR``), the current process *is* one rank and joins with env:// rendezvous.

gloo on the CPU, nccl on GPUs. Each rank takes its contiguous slice of the same global
batch the single-device run uses, and the loss is scaled so DDP's gradient averaging
gives exactly the global-batch gradient: with equal seeds DDP(N) matches one device up
to floating-point summation order. Only rank 0 writes files.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.harness.config import TrainConfig, TrainResult
from ckpt_tools.harness.data import batch_indices, shard, synthetic_fashion
from ckpt_tools.harness.loop import (
    completed_epochs,
    deterministic,
    init_model,
    local_loss,
    make_optimizer,
    save_checkpoints,
)
from ckpt_tools.harness.models import build_model, has_batchnorm
from ckpt_tools.harness.placement import resolve_devices

__all__ = ["TorchrunEnv", "torchrun_env", "train_ddp"]

#: Environment variables torchrun sets for every worker; all present means "under torchrun".
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
# A rank that waits longer than this for the others has lost them (crashed peer).
_PG_TIMEOUT = timedelta(minutes=3)
_SPAWN_ATTEMPTS = 3


@dataclass(frozen=True)
class TorchrunEnv:
    """The rendezvous variables of one torchrun worker."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """Detect a torchrun (or any env:// launcher) worker from its environment.

    Args:
        environ: the environment to read; ``os.environ`` by default.

    Returns:
        The rank layout, or ``None`` when a variable of :data:`TORCHRUN_VARS` is missing.

    Example:
        >>> torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...               "MASTER_ADDR": "127.0.0.1"}).rank
        1
    """
    env = os.environ if environ is None else environ
    if not all(env.get(name) for name in TORCHRUN_VARS):
        return None
    world = int(env["WORLD_SIZE"])
    return TorchrunEnv(
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
    )


def train_ddp(config: TrainConfig) -> TrainResult:
    """Run DDP training, spawning the ranks or, under torchrun, acting as one of them.

    Args:
        config: the run; ``strategy`` is taken to be ``ddp``.

    Returns:
        Spawned: rank 0's result. Under torchrun: this rank's result (only rank 0 wrote
        the checkpoints and ``run.json``).

    Raises:
        UsageError: torchrun's world size differs from ``config.world_size``, more ranks
            than GPUs, or SyncBatchNorm asked for on the CPU.
        RuntimeError: a spawned worker failed; the message carries its traceback.

    Example:
        >>> train_ddp(TrainConfig(strategy="ddp", world_size=2, steps=2)).backend  # doctest: +SKIP
        'gloo'
    """
    env = torchrun_env()
    if env is not None:
        if config.world_size is not None and config.world_size != env.world_size:
            raise UsageError(
                f"torchrun started {env.world_size} processes",
                argument="world_size",
                value=repr(config.world_size),
                flag="--world-size",
                remedies=(
                    Remedy("world_size", verb="drop", flag="--world-size"),
                    Remedy(text="match torchrun's --nproc-per-node"),
                ),
            )
        devices = resolve_devices(env.local_world_size, config.gpus, config.device)
        _check_ranks(config, env.world_size, devices[0])
        return _worker(
            env.rank, env.world_size, devices, env.local_rank, config, "env://", "torchrun"
        )
    devices = resolve_devices(config.world_size, config.gpus, config.device)
    _check_ranks(config, len(devices), devices[0])
    return _spawn(config, devices)


def _check_ranks(config: TrainConfig, world: int, device: torch.device) -> None:
    """Refuse what would fail inside the workers, before any process starts."""
    build_model(config.model, **dict(config.model_kwargs))  # bad model_kwargs: UsageError here
    if config.batch_size < world:
        raise UsageError(
            f"is smaller than the {world} ranks",
            argument="batch_size",
            value=repr(config.batch_size),
            flag="--batch-size",
            remedies=(
                Remedy("batch_size", verb="raise", flag="--batch-size"),
                Remedy(
                    "world_size",
                    verb="lower",
                    flag="--world-size",
                    text="(or torchrun's --nproc-per-node)",
                ),
            ),
        )
    _check_sync_bn(config, device)


def _wants_sync_bn(config: TrainConfig, device: torch.device) -> bool:
    """SyncBatchNorm when asked for, else when the model has BatchNorm and runs on GPUs."""
    if config.model.lower() == "resnet-syncbn":
        return True
    if config.sync_bn is not None:
        return config.sync_bn
    return device.type == "cuda" and has_batchnorm(build_model(config.model, **config.model_kwargs))


def _check_sync_bn(config: TrainConfig, device: torch.device) -> None:
    """Refuse SyncBatchNorm on the CPU before any process starts: torch has no CPU kernel."""
    if device.type == "cpu" and _wants_sync_bn(config, device):
        raise UsageError(
            "SyncBatchNorm needs GPUs (torch implements it for CUDA only), but this DDP run "
            "is on the CPU",
            remedies=(
                Remedy("model", "'resnet'", flag="--model resnet", text="(BatchNorm per rank)"),
                Remedy(text="run on GPUs"),
            ),
        )


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(config: TrainConfig, devices: Sequence[torch.device]) -> TrainResult:
    """Start one process per device and return rank 0's result."""
    world = len(devices)
    with tempfile.TemporaryDirectory(prefix="ckpt-harness-ddp-") as scratch:
        # Rank 0 reports through run.json: in out_dir when there is one, else a scratch dir.
        report_dir = config.out_dir if config.out_dir is not None else scratch
        started = time.perf_counter()
        for attempt in range(_SPAWN_ATTEMPTS):
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            try:
                mp.spawn(
                    _spawn_entry,
                    args=(world, [str(d) for d in devices], config, init_method, report_dir),
                    nprocs=world,
                    join=True,
                )
                break
            except ProcessException as exc:
                # Another process may grab the free port before rank 0 binds it; retry then.
                port_taken = "address already in use" in str(exc).lower()
                if port_taken and attempt + 1 < _SPAWN_ATTEMPTS:
                    continue
                raise RuntimeError(f"a DDP worker process failed:\n{exc}") from exc
        result = TrainResult.read_json(report_dir)
        return replace(result, seconds=time.perf_counter() - started)


def _spawn_entry(
    rank: int,
    world: int,
    devices: list[str],
    config: TrainConfig,
    init_method: str,
    report_dir: str,
) -> None:
    """``mp.spawn`` target: one rank of an internally started run."""
    local = [torch.device(d) for d in devices]
    _worker(rank, world, local, rank, config, init_method, "spawn", report_dir)


def _worker(
    rank: int,
    world: int,
    devices: Sequence[torch.device],
    local_rank: int,
    config: TrainConfig,
    init_method: str,
    launcher: str,
    report_dir: str | None = None,
) -> TrainResult:
    """Join the process group, train on ``devices[local_rank]``, let rank 0 save, leave."""
    device = devices[local_rank]
    # Ranks share the machine's cores; one thread each avoids oversubscription (and keeps
    # CPU kernels on the same single-threaded code path in every rank).
    torch.set_num_threads(1)
    if device.type == "cuda":
        # The worker process is ours, so this global setting is fine here; it lets cuBLAS
        # run deterministically under use_deterministic_algorithms.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=_PG_TIMEOUT
    )
    try:
        sync_bn = _wants_sync_bn(config, device)
        result = _train(rank, world, device, config, sync_bn, backend, launcher)
        result = replace(result, devices=tuple(str(d) for d in devices))
        if rank == 0:
            if config.out_dir is not None:
                result = replace(result, out_dir=str(config.out_dir))
            target = report_dir if report_dir is not None else config.out_dir
            if target is not None:
                Path(target).mkdir(parents=True, exist_ok=True)
                result.write_json(target)
        # Nobody leaves before rank 0 has written, so a launcher sees complete files.
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _train(
    rank: int,
    world: int,
    device: torch.device,
    config: TrainConfig,
    sync_bn: bool,
    backend: str,
    launcher: str,
) -> TrainResult:
    """The DDP training loop of one rank; rank 0 saves the checkpoints."""
    model = init_model(config, sync_bn=sync_bn).to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = make_optimizer(ddp.parameters(), config)
    images, labels = synthetic_fashion(config.num_samples, config.seed).tensors
    losses: list[float] = []
    started = time.perf_counter()
    with deterministic():
        for step in range(config.steps):
            idx = batch_indices(step, config.num_samples, config.batch_size, config.seed)
            local = shard(idx, rank, world)
            x, y = images[local].to(device), labels[local].to(device)
            loss = local_loss(ddp(x), y, len(idx), world)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over ranks here
            optimizer.step()
            # Sum of the scaled local losses over ranks / world = global-batch mean loss.
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            losses.append(float(logged) / world)
    checkpoints: dict[str, str] = {}
    if rank == 0 and config.out_dir is not None:
        checkpoints = save_checkpoints(
            config.out_dir, ddp.state_dict(), ddp.module.state_dict(), optimizer, config
        )
    fallback = None
    if device.type == "cpu":
        why = "device='cpu'" if torch.cuda.is_available() else "no GPU"
        fallback = f"{why}: {world} CPU processes over gloo"
    return TrainResult(
        strategy="ddp",
        model=config.model,
        world_size=world,
        devices=(str(device),),
        losses=tuple(losses),
        steps=config.steps,
        epoch=completed_epochs(config),
        fallback=fallback,
        backend=backend,
        launcher=launcher,
        sync_bn=sync_bn,
        checkpoints=checkpoints,
        seconds=time.perf_counter() - started,
    )
