"""The ``train`` entry point, and the in-process strategies ``single`` and ``dp``.

``manual`` lives in :mod:`ckpt_tools.harness.manual`, ``ddp`` in
:mod:`ckpt_tools.harness.ddp`, ``fsdp`` in :mod:`ckpt_tools.harness.fsdp` and ``zero``
(DeepSpeed) in :mod:`ckpt_tools.harness.zero.strategy` (imported
only when asked for, so that nothing else pays for ``torch.distributed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from ckpt_tools.harness.config import (
    TrainConfig,
    TrainResult,
    check_batch_covers,
    check_torchrun_fit,
    torchrun_env,
)
from ckpt_tools.harness.loop import (
    ModuleContainer,
    cpu_fallback,
    deterministic,
    finish_run,
    global_batches,
    init_model,
    local_loss,
    make_optimizer,
)
from ckpt_tools.harness.outputs import check_outputs, clear_outputs
from ckpt_tools.harness.placement import resolve_devices

__all__ = ["run_steps", "train"]


def train(config: TrainConfig) -> TrainResult:
    """Train ``config.model`` for ``config.steps`` SGD steps with ``config.strategy``.

    Args:
        config: the run. With ``out_dir`` set, ``wrapped.pt``, ``bare.pt``, ``trainer.pt``
            and ``run.json`` are written there (for DDP by rank 0 only).

    Returns:
        The losses, devices, fallbacks and checkpoint paths of the run. Under
        ``torchrun`` (strategy ``ddp``), every rank returns; only rank 0 wrote files.

    Raises:
        UsageError: bad strategy/model/sizes, more ranks than selected GPUs, or a
            one-process strategy under torchrun.
        OSError: ``out_dir`` cannot be cleared (see below) or written.
        RankFailedError: a rank of ``ddp``, ``fsdp`` or ``zero`` failed or was killed: one
            line naming the rank, with the rank's own error and exit code.
        RuntimeError: a rank met a bug of the harness (its traceback is in the message).

    An ``out_dir`` that holds an earlier run keeps everything but what this strategy writes
    (:data:`~ckpt_tools.harness.outputs.STRATEGY_OUTPUTS`), which is removed first.

    Example:
        >>> result = train(TrainConfig(strategy="single", steps=2, device="cpu"))
        >>> len(result.losses)
        2
    """
    config.validate()
    env = torchrun_env()
    if env is not None:
        check_torchrun_fit(config, env)
    if config.out_dir is not None:  # refused before any rank starts, not by one of them
        check_outputs(config.out_dir, config.strategy, config.record_steps)
    if config.strategy == "ddp":
        from ckpt_tools.harness.ddp import train_ddp  # keeps torch.distributed out otherwise

        return train_ddp(config)
    if config.strategy == "fsdp":
        from ckpt_tools.harness.fsdp import train_fsdp

        return train_fsdp(config)
    if config.strategy == "zero":
        from ckpt_tools.harness.zero.strategy import train_zero

        return train_zero(config)
    world_size = 1 if config.strategy == "single" else config.world_size
    devices = resolve_devices(world_size, config.gpus, config.device)
    check_replicas_batch(config, devices)
    if config.out_dir is not None:
        clear_outputs(config.out_dir, config.strategy, config.record_steps)
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


def check_replicas_batch(config: TrainConfig, devices: Sequence[torch.device]) -> None:
    """Refuse a global batch that leaves one of a one-process strategy's replicas without
    samples (``manual``; ``dp`` on GPUs: on the CPU it is one plain forward).

    Raises:
        UsageError: ``batch_size`` smaller than the replicas.
    """
    if config.strategy == "manual" or (config.strategy == "dp" and devices[0].type == "cuda"):
        check_batch_covers(config.batch_size, len(devices), "replicas")


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
    losses: list[float] = []
    with deterministic():
        for images, labels in global_batches(config):
            x, y = images.to(input_device), labels.to(input_device)
            loss = local_loss(forward(x), y, len(y), 1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    return losses


def _train_single(config: TrainConfig, device: torch.device) -> TrainResult:
    """One model, one device, the whole global batch per step."""
    model = init_model(config).to(device)
    optimizer = make_optimizer(model.parameters(), config)
    losses = run_steps(model, optimizer, config, device)
    # Wrapped checkpoint: the DataParallel key layout without DataParallel (see ModuleContainer).
    return finish_run(config, [device], losses, ModuleContainer(model), model, optimizer, None)


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
        fallback = cpu_fallback(devices, f"DataParallel ran as a plain forward on the CPU{asked}")
        # device='cpu' on a GPU machine: DataParallel would pull the model onto a GPU, so
        # keep its key layout with the container and forward plainly. Without CUDA,
        # DataParallel keeps device_ids empty and just calls the module.
        wrapper = ModuleContainer(model) if torch.cuda.is_available() else nn.DataParallel(model)
        used = [devices[0]]
    optimizer = make_optimizer(model.parameters(), config)
    losses = run_steps(wrapper, optimizer, config, devices[0])
    return finish_run(config, used, losses, wrapper, model, optimizer, fallback)
