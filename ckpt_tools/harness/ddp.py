"""The ``ddp`` strategy: DistributedDataParallel, one process per device.

The same worker code runs whichever way the processes were started:

* internally: :func:`train_ddp` finds a free port on 127.0.0.1 and starts ``world_size``
  processes with ``torch.multiprocessing`` (tcp:// rendezvous, :mod:`~.spawning`);
* externally: under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``
  set), the current process *is* one rank and joins with env:// rendezvous.

gloo on the CPU, nccl on GPUs. Each rank takes its contiguous slice of the same global
batch the single-device run uses, and the loss is scaled so DDP's gradient averaging
gives exactly the global-batch gradient: with equal seeds DDP(N) matches one device up
to floating-point summation order. Only rank 0 writes files.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel

from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.harness import loop
from ckpt_tools.harness.config import (
    SMALL_BATCH_REMEDIES,
    TrainConfig,
    TrainResult,
    check_batch_covers,
    check_torchrun_fit,
    torchrun_env,
)
from ckpt_tools.harness.data import shard
from ckpt_tools.harness.failures import (
    PeerLostError,
    join_group,
    peer_lost,
    port_taken,
    ports_taken_error,
    quiet_spawn_log,
    rank_failure,
    stop_ranks,
    write_failure,
)
from ckpt_tools.harness.models import build_harness_model, has_batchnorm
from ckpt_tools.harness.outputs import clear_outputs
from ckpt_tools.harness.placement import resolve_devices
from ckpt_tools.harness.spawning import (
    adopt_environment,
    end_with_launcher,
    free_port,
    scratch_folder,
    start_method,
)

__all__ = ["TrainRank", "launch", "rank_result", "train_ddp", "train_steps"]

# A rank that waits longer than this for the others has lost them (crashed peer).
_PG_TIMEOUT = timedelta(minutes=3)
_SPAWN_ATTEMPTS = 3

#: One rank's training: ``(rank, world, device, config, sync_bn, backend, launcher)`` ->
#: that rank's result; it saves the checkpoints itself (rank 0, or every rank for DCP).
#: A module-level function, so that ``mp.spawn`` can pickle it by name.
TrainRank = Callable[[int, int, torch.device, TrainConfig, bool, str, str], TrainResult]


def rank_result(
    result: TrainResult,
    device: torch.device,
    backend: str,
    launcher: str,
    sync_bn: bool,
    seconds: float,
) -> TrainResult:
    """One rank's result: ``result`` (from ``loop.finish_run``) with this rank's own launch.

    Args:
        result: the run as ``loop.finish_run`` described it (every rank's device).
        device: this rank's device: a rank reports its own, the launcher gathers them.
        backend: the process group's backend.
        launcher: ``spawn`` or ``torchrun``.
        sync_bn: whether BatchNorm was converted to SyncBatchNorm.
        seconds: wall time of this rank's training.

    Returns:
        ``result`` with those fields replaced.

    Example:
        >>> run = TrainResult("ddp", "mlp", 2, ("cpu", "cpu"), (2.3,), steps=1, epoch=0)
        >>> rank = rank_result(run, torch.device("cpu"), "gloo", "spawn", False, 0.5)
        >>> rank.devices, rank.world_size, rank.backend, rank.seconds
        (('cpu',), 2, 'gloo', 0.5)
    """
    return replace(
        result,
        devices=(str(device),),
        backend=backend,
        launcher=launcher,
        sync_bn=sync_bn,
        seconds=seconds,
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
        RankFailedError: a spawned rank failed (its own error and exit code, the rank
            named) or was killed by a signal.
        RuntimeError: a spawned rank met a bug of the harness; the message carries its
            traceback.

    Example:
        >>> train_ddp(TrainConfig(strategy="ddp", world_size=2, steps=2)).backend  # doctest: +SKIP
        'gloo'
        >>> train_ddp(TrainConfig(strategy="ddp", world_size=2, batch_size=1, device="cpu"))
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: batch_size=1: leaves some of the 2 ranks without samples; ...
    """
    return launch(config, _train)


def launch(config: TrainConfig, train_rank: TrainRank) -> TrainResult:
    """Run ``train_rank`` on every rank: spawned here, or as this torchrun worker's rank.

    The launch and rendezvous every multi-process strategy shares (``ddp``, ``fsdp``):
    checks before any process starts, the process group (gloo on the CPU, nccl on GPUs),
    rank 0's ``run.json``, and the barrier before anyone leaves.

    Args:
        config: the run.
        train_rank: one rank's training (see :data:`TrainRank`).

    Returns:
        Spawned: rank 0's result. Under torchrun: this rank's result.

    Raises:
        UsageError: see :func:`train_ddp`.
        RankFailedError: a spawned rank failed (its own error and exit code, the rank
            named) or was killed by a signal.
        RuntimeError: a spawned rank met a bug of the harness; the message carries its
            traceback.
    """
    env = torchrun_env()
    if env is not None:
        check_torchrun_fit(config, env)
        devices = resolve_devices(env.local_world_size, config.gpus, config.device)
        _check_ranks(config, env.world_size, devices[0])
        return _worker(
            env.rank,
            env.world_size,
            devices,
            env.local_rank,
            config,
            "env://",
            "torchrun",
            train_rank=train_rank,
        )
    devices = resolve_devices(config.world_size, config.gpus, config.device)
    _check_ranks(config, len(devices), devices[0])
    return _spawn(config, devices, train_rank)


def _check_ranks(config: TrainConfig, world: int, device: torch.device) -> None:
    """Refuse what would fail inside the workers, before any process starts."""
    # Bad model_kwargs: a UsageError here, not a traceback in every worker.
    build_harness_model(config.model, **dict(config.model_kwargs))
    torchrun_fix = "(or torchrun's --nproc-per-node)"
    remedies = (SMALL_BATCH_REMEDIES[0], replace(SMALL_BATCH_REMEDIES[1], text=torchrun_fix))
    check_batch_covers(config.batch_size, world, "ranks", remedies)
    _check_sync_bn(config, device)


def _wants_sync_bn(config: TrainConfig, device: torch.device) -> bool:
    """SyncBatchNorm when asked for, else when the model has BatchNorm and runs on GPUs."""
    if config.model.lower() == "resnet-syncbn":
        return True
    if config.sync_bn is not None:
        return config.sync_bn
    if device.type != "cuda":
        return False
    return has_batchnorm(build_harness_model(config.model, **config.model_kwargs))


def _check_sync_bn(config: TrainConfig, device: torch.device) -> None:
    """Refuse SyncBatchNorm on the CPU before any process starts: torch has no CPU kernel."""
    if device.type == "cpu" and _wants_sync_bn(config, device):
        raise UsageError(
            "SyncBatchNorm needs GPUs (torch implements it for CUDA only), but this "
            f"{config.strategy} run is on the CPU",
            remedies=(
                Remedy("model", "'resnet'", flag="--arch resnet", text="(BatchNorm per rank)"),
                Remedy(text="run on GPUs"),
            ),
        )


def _spawn(config: TrainConfig, devices: Sequence[torch.device], train: TrainRank) -> TrainResult:
    """Start one process per device and return rank 0's result."""
    world = len(devices)
    with scratch_folder("ckpt-harness-ddp-") as scratch:  # (SIGTERM: ranks stopped too)
        # Rank 0 reports through run.json: in out_dir when there is one, else a scratch dir.
        report_dir = config.out_dir if config.out_dir is not None else scratch
        started = time.perf_counter()
        for attempt in range(_SPAWN_ATTEMPTS):
            failures = Path(scratch, f"failures-{attempt}")
            failures.mkdir()
            init_method = f"tcp://127.0.0.1:{free_port()}"
            args = (world, [str(d) for d in devices], config, init_method, report_dir)
            context = mp.start_processes(
                _spawn_entry,
                args=(*args, train, str(failures), dict(os.environ), os.getpid()),
                nprocs=world,
                join=False,
                start_method=start_method(),
            )
            try:
                with quiet_spawn_log():
                    while not context.join():
                        pass
                break
            except ProcessException as exc:
                # Another process may grab the free port before rank 0 binds it; retry then.
                if port_taken(failures, exc):
                    if attempt + 1 < _SPAWN_ATTEMPTS:
                        continue
                    raise ports_taken_error(_SPAWN_ATTEMPTS) from exc
                codes = [process.exitcode for process in context.processes]
                what = config.strategy.upper()
                raise rank_failure(failures, world, codes, exc.error_index, what) from exc
            except BaseException:  # Ctrl-C to the launcher alone: the ranks end, not at exit
                stop_ranks(context.processes)
                raise
        result = TrainResult.read_json(report_dir)
        return replace(result, seconds=time.perf_counter() - started)


def _spawn_entry(
    rank: int,
    world: int,
    devices: list[str],
    config: TrainConfig,
    init_method: str,
    report_dir: str,
    train_rank: TrainRank,
    failures: str,
    environ: dict[str, str],
    launcher: int,
) -> None:
    """``mp.start_processes`` target: one rank of an internally started run, ending with
    its ``launcher``; a failure is summarised into ``failures`` for the launcher first."""
    end_with_launcher(launcher)
    adopt_environment(environ)
    local = [torch.device(d) for d in devices]
    try:
        _worker(rank, world, local, rank, config, init_method, "spawn", report_dir, train_rank)
    except Exception as exc:
        write_failure(failures, rank, exc)
        raise
    except KeyboardInterrupt:  # torch's spawn wrapper swallows it: end as SIGINT ends one
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    # Threads of gloo and of DeepSpeed can abort the interpreter's own exit after a complete
    # run (the ranks have written and passed the last barrier): leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(
    rank: int,
    world: int,
    devices: Sequence[torch.device],
    local_rank: int,
    config: TrainConfig,
    init_method: str,
    launcher: str,
    report_dir: str | None = None,
    train_rank: TrainRank | None = None,
) -> TrainResult:
    """Join the process group, train on ``devices[local_rank]``, let rank 0 save, leave."""
    train_rank = _train if train_rank is None else train_rank
    device = devices[local_rank]
    # Ranks share the machine's cores; one thread each avoids oversubscription (and keeps
    # CPU kernels on one code path in every rank, as placement.one_thread does in process).
    torch.set_num_threads(1)
    if device.type == "cuda":
        # The worker process is ours, so this global setting is fine here; it lets cuBLAS
        # run deterministically under use_deterministic_algorithms.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    join_group(backend, init_method, rank, world, _PG_TIMEOUT)
    try:
        if rank == 0 and config.out_dir is not None:
            clear_outputs(config.out_dir, config.strategy, config.record_steps)
        dist.barrier()  # nobody writes into out_dir before rank 0 has cleared it
        sync_bn = _wants_sync_bn(config, device)
        result = train_rank(rank, world, device, config, sync_bn, backend, launcher)
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
    except RuntimeError as exc:  # torch.distributed's DistError is one too
        if not peer_lost(exc):
            raise
        raise PeerLostError(rank, world, exc) from exc
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
    model = loop.init_model(config, sync_bn=sync_bn).to(device)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = loop.make_optimizer(ddp.parameters(), config)
    started = time.perf_counter()
    losses = train_steps(ddp, optimizer, config, rank, world, device)
    fallback = loop.cpu_fallback([device], f"{world} CPU processes over gloo")
    result = loop.finish_run(
        config, [device] * world, losses, ddp, ddp.module, optimizer, fallback, save=rank == 0
    )
    return rank_result(result, device, backend, launcher, sync_bn, time.perf_counter() - started)


def train_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
) -> list[float]:
    """One rank's training steps on its slice of each global batch.

    Args:
        model: the wrapped model (DDP, FSDP), which averages the gradients over the ranks
            in ``backward``.
        optimizer: steps ``model``'s parameters.
        config: the run (steps, batches, seed).
        rank: this process's rank.
        world: the number of ranks.
        device: this rank's device.

    Returns:
        The global-batch mean loss of every step, the same on every rank.
    """
    losses: list[float] = []
    with loop.deterministic():
        for images, labels in loop.global_batches(config):
            x, y = shard(images, rank, world).to(device), shard(labels, rank, world).to(device)
            loss = loop.local_loss(model(x), y, len(labels), world)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # Sum of the scaled local losses over ranks / world = global-batch mean loss.
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            losses.append(float(logged) / world)
    return losses
