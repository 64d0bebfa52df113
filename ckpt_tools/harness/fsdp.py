"""The ``fsdp`` strategy: FSDP2 (``fully_shard``), one process per device, saved with DCP.

Launched exactly as ``ddp`` is (:func:`ckpt_tools.harness.ddp.launch`: spawned here over
tcp://, or as one rank under ``torchrun`` with env:// rendezvous; gloo on the CPU, nccl on
GPUs). Every parameter is sharded on dim 0 over the ranks: each layer with parameters is
its own FSDP unit, and the root holds the rest. Each rank takes its slice of the global
batch and the loss is scaled as for DDP, so FSDP's averaging reduce-scatter gives the
global-batch gradient and FSDP(N) matches one device up to summation order.

After training, every rank takes part in two saves:

* ``dcp/``: ``torch.distributed.checkpoint.save`` of ``{"model": ..., "optim": ...}``, the
  sharded state dicts of ``get_state_dict`` (each rank writes its own ``__{rank}_0.distcp``);
* the full state dict gathered on rank 0 (``get_model_state_dict`` with
  ``full_state_dict=True, cpu_offload=True``), which rank 0 writes as ``bare.pt``, as
  ``wrapped.pt`` (``module.`` keys, as DDP names them: ``fully_shard`` keeps the model's own
  keys) and, with the gathered optimizer state (keyed by
  parameter name, as ``get_optimizer_state_dict`` gives it), as ``trainer.pt``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_tools.errors import UsageError
from ckpt_tools.harness import loop
from ckpt_tools.harness.config import TrainConfig, TrainResult
from ckpt_tools.harness.ddp import launch, rank_result, train_steps

__all__ = ["DCP_DIR", "FSDP_MIN_TORCH", "fsdp_missing", "train_fsdp"]

#: The DCP checkpoint's folder inside the run's ``out_dir``.
DCP_DIR = "dcp"


#: The first torch whose FSDP2 trains on the CPU (gloo) as one device does. In 2.6, where
#: ``fully_shard`` became public, it fails there; 2.7 and 2.8 train, but the parity check
#: against one device fails. (2.4 and 2.5 have FSDP2 under a private name, wanting CUDA.)
FSDP_MIN_TORCH = (2, 9)


def fsdp_missing() -> str | None:
    """Why the ``fsdp`` strategy cannot run with this torch, or None when it can.

    Returns:
        ``"the fsdp strategy needs torch 2.9 or newer ...: pip install 'torch>=2.9'"``, or None.

    Example:
        >>> fsdp_missing() is None  # torch 2.9 and newer
        True
    """
    from torch.torch_version import TorchVersion  # torch's own version comparison

    if TorchVersion(torch.__version__) >= FSDP_MIN_TORCH:
        return None
    wanted = ".".join(map(str, FSDP_MIN_TORCH))
    return (
        f"the fsdp strategy needs torch {wanted} or newer (FSDP2), found torch "
        f"{torch.__version__}: pip install 'torch>={wanted}'"
    )


def train_fsdp(config: TrainConfig) -> TrainResult:
    """Run FSDP2 training, spawning the ranks or, under torchrun, acting as one of them.

    Args:
        config: the run; ``strategy`` is taken to be ``fsdp``.

    Returns:
        Spawned: rank 0's result. Under torchrun: this rank's result. With ``out_dir``,
        ``checkpoints`` names ``wrapped``, ``bare``, ``trainer`` and ``dcp`` (the folder).

    Raises:
        UsageError: torch is older than 2.9 (:func:`fsdp_missing`); otherwise as
            :func:`ckpt_tools.harness.ddp.train_ddp`.
        RankFailedError: a spawned rank failed or was killed (see
            :func:`ckpt_tools.harness.ddp.train_ddp`).
        RuntimeError: a spawned rank met a bug of the harness (its traceback included).

    Example:
        >>> config = TrainConfig(strategy="fsdp", world_size=2, steps=2, out_dir="o")
        >>> sorted(train_fsdp(config).checkpoints)  # doctest: +SKIP
        ['bare', 'dcp', 'trainer', 'wrapped']
        >>> train_fsdp(TrainConfig(strategy="fsdp", world_size=2, batch_size=1, device="cpu"))
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: batch_size=1: leaves some of the 2 ranks without samples; ...
    """
    why = fsdp_missing()
    if why is not None:
        raise UsageError(why)
    return launch(config, train_rank)


def _shard(model: nn.Module, mesh: Any) -> None:
    """Every submodule with parameters of its own is an FSDP unit; the root takes the rest."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules())[1:]:
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_rank(
    rank: int,
    world: int,
    device: torch.device,
    config: TrainConfig,
    sync_bn: bool,
    backend: str,
    launcher: str,
) -> TrainResult:
    """One rank's FSDP2 training and its part of the saves (see the module docstring).

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
    from torch.distributed.device_mesh import init_device_mesh

    model = loop.init_model(config, sync_bn=sync_bn).to(device)
    _shard(model, init_device_mesh(device.type, (world,)))
    optimizer = loop.make_optimizer(model.parameters(), config)
    started = time.perf_counter()
    # FSDP reduce-scatters and averages the gradients in backward.
    losses = train_steps(model, optimizer, config, rank, world, device)
    seconds = time.perf_counter() - started
    # Buffers (BatchNorm statistics) are not sharded: each rank kept its own. Rank 0's go to
    # every rank, as DDP broadcasts them, so that the DCP save (which keeps one rank's copy
    # of a replicated tensor) and the gathered state agree.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    checkpoints = _save(model, optimizer, config, rank) if config.out_dir is not None else {}
    fallback = loop.cpu_fallback([device], f"{world} CPU processes over gloo")
    # The files are written above, not by finish_run.
    result = loop.finish_run(
        config, [device] * world, losses, model, model, optimizer, fallback, written=checkpoints
    )
    return rank_result(result, device, backend, launcher, sync_bn, seconds)


def _save(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, rank: int
) -> dict[str, str]:
    """The DCP save (every rank writes its shards) and rank 0's gathered ``.pt`` files.

    Collective: every rank must call it. Returns the paths on rank 0, ``{}`` elsewhere.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )

    out = Path(str(config.out_dir))
    out.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / DCP_DIR))
    except dcp.api.CheckpointException as e:
        # A BaseException gathering the ranks' errors: this rank raises its own (else the
        # first one), an OSError for a full disk or an existing file, said in one line.
        error, _trace = e.failures.get(rank) or min(e.failures.items())[1]
        raise error from e
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    bare = get_model_state_dict(model, options=full)
    optim_full = get_optimizer_state_dict(model, optimizer, options=full)
    if rank != 0:
        return {}
    bare = OrderedDict(bare)
    wrapped = OrderedDict((f"module.{k}", v) for k, v in bare.items())
    paths = loop.save_checkpoints(out, wrapped, bare, optim_full, config)
    return {**paths, "dcp": str(out / DCP_DIR)}
