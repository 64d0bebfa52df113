"""The ``train`` entry point, and the in-process strategies ``single`` and ``dp``.

``manual`` lives in :mod:`ckpt_tools.harness.manual` and ``ddp`` in
:mod:`ckpt_tools.harness.ddp` (imported only when asked for, so that nothing else pays
for ``torch.distributed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from ckpt_tools.errors import UsageError
from ckpt_tools.harness.config import SMALL_BATCH_REMEDIES, TrainConfig, TrainResult
from ckpt_tools.harness.data import batch_indices, synthetic_fashion
from ckpt_tools.harness.loop import (
    ModuleContainer,
    completed_epochs,
    deterministic,
    init_model,
    local_loss,
    make_optimizer,
    save_checkpoints,
)
from ckpt_tools.harness.placement import resolve_devices

__all__ = ["DP_CPU_FALLBACK", "train"]

#: ``TrainResult.fallback`` of the ``dp`` strategy when there is no GPU.
DP_CPU_FALLBACK = "no GPU: DataParallel ran as a plain forward on the CPU"


def train(config: TrainConfig) -> TrainResult:
    """Train ``config.model`` for ``config.steps`` SGD steps with ``config.strategy``.

    Args:
        config: the run. With ``out_dir`` set, ``wrapped.pt``, ``bare.pt``, ``trainer.pt``
            and ``run.json`` are written there (for DDP by rank 0 only).

    Returns:
        The losses, devices, fallbacks and checkpoint paths of the run. Under
        ``torchrun`` (strategy ``ddp``), every rank returns; only rank 0 wrote files.

    Raises:
        UsageError: bad strategy/model/sizes, or more ranks than selected GPUs.
        RuntimeError: a DDP worker process failed (its traceback is in the message).

    Example:
        >>> result = train(TrainConfig(strategy="single", steps=2, device="cpu"))
        >>> len(result.losses)
        2
    """
    config.validate()
    if config.strategy == "ddp":
        from ckpt_tools.harness.ddp import train_ddp  # keeps torch.distributed out otherwise

        return train_ddp(config)
    world_size = 1 if config.strategy == "single" else config.world_size
    devices = resolve_devices(world_size, config.gpus, config.device)
    if config.batch_size < len(devices):
        raise UsageError(
            f"is smaller than the {len(devices)} replicas",
            argument="batch_size",
            value=repr(config.batch_size),
            flag="--batch-size",
            remedies=SMALL_BATCH_REMEDIES,
        )
    started = time.perf_counter()
    if config.strategy == "manual":
        from ckpt_tools.harness.manual import train_manual

        result = train_manual(config, devices)
    elif config.strategy == "dp":
        result = _train_dp(config, devices)
    else:
        result = _train_single(config, devices[0])
    result = replace(result, seconds=time.perf_counter() - started)
    if config.out_dir is not None:
        result.write_json(config.out_dir)
    return result


def run_steps(
    forward: Callable[[Tensor], Tensor],
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    input_device: torch.device,
) -> list[float]:
    """The plain training loop: whole global batch in, mean loss, one SGD step.

    Args:
        forward: the (possibly wrapped) model.
        optimizer: its optimizer.
        config: steps, batch size, seeds.
        input_device: where the batch has to be for ``forward``.

    Returns:
        The loss of every step.

    Example:
        >>> model = init_model(TrainConfig())
        >>> opt = make_optimizer(model.parameters(), TrainConfig())
        >>> len(run_steps(model, opt, TrainConfig(steps=2), torch.device("cpu")))
        2
    """
    images, labels = synthetic_fashion(config.num_samples, config.seed).tensors
    losses: list[float] = []
    with deterministic():
        for step in range(config.steps):
            idx = batch_indices(step, config.num_samples, config.batch_size, config.seed)
            x, y = images[idx].to(input_device), labels[idx].to(input_device)
            loss = local_loss(forward(x), y, len(idx), 1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses


def _result(
    config: TrainConfig,
    devices: Sequence[torch.device],
    losses: list[float],
    wrapped: nn.Module,
    bare: nn.Module,
    optimizer: torch.optim.Optimizer,
    fallback: str | None,
) -> TrainResult:
    """Save the checkpoints (when asked to) and describe the run."""
    checkpoints: dict[str, str] = {}
    if config.out_dir is not None:
        checkpoints = save_checkpoints(
            config.out_dir, wrapped.state_dict(), bare.state_dict(), optimizer, config
        )
    return TrainResult(
        strategy=config.strategy,
        model=config.model,
        world_size=len(devices),
        devices=tuple(str(d) for d in devices),
        losses=tuple(losses),
        steps=config.steps,
        epoch=completed_epochs(config),
        fallback=fallback,
        out_dir=None if config.out_dir is None else str(config.out_dir),
        checkpoints=checkpoints,
    )


def _train_single(config: TrainConfig, device: torch.device) -> TrainResult:
    """One model, one device, the whole global batch per step."""
    model = init_model(config).to(device)
    optimizer = make_optimizer(model.parameters(), config)
    losses = run_steps(model, optimizer, config, device)
    # Wrapped checkpoint: the DataParallel key layout without DataParallel (see ModuleContainer).
    return _result(config, [device], losses, ModuleContainer(model), model, optimizer, None)


def _train_dp(config: TrainConfig, devices: Sequence[torch.device]) -> TrainResult:
    """``nn.DataParallel`` over the GPUs; a plain forward on the CPU when there are none."""
    model = init_model(config).to(devices[0])
    wrapper: nn.Module
    if devices[0].type == "cuda":
        ids = [d.index for d in devices]
        wrapper = nn.DataParallel(model, device_ids=ids, output_device=ids[0])
        fallback, used = None, list(devices)
    else:
        asked = f" (asked for {len(devices)} replicas)" if len(devices) > 1 else ""
        if torch.cuda.is_available():
            # device='cpu' on a GPU machine: DataParallel would pull the model onto a
            # GPU, so keep its key layout with the container and forward plainly.
            wrapper = ModuleContainer(model)
            fallback = f"device='cpu': DataParallel ran as a plain forward on the CPU{asked}"
        else:
            # Without CUDA, DataParallel keeps device_ids empty and just calls the module.
            wrapper = nn.DataParallel(model)
            fallback = DP_CPU_FALLBACK + asked
        used = [devices[0]]
    optimizer = make_optimizer(model.parameters(), config)
    losses = run_steps(wrapper, optimizer, config, devices[0])
    return _result(config, used, losses, wrapper, model, optimizer, fallback)
