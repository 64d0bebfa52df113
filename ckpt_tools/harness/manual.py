"""The ``manual`` strategy: data parallelism by hand, as the multi-GPU tutorials teach it.

Per step: scatter the global batch into N chunks, run forward/backward on N replicas
(one per device; N CPU replicas, one after another, when there is no GPU), all-reduce
the gradients by hand (sum onto the master, divide by N), take one optimizer step on the
master, and broadcast its parameters and buffers back to the replicas.

No ``torch.distributed``: everything happens in this process, which is the point of the
exercise, and what lets it run over CPU replicas.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ckpt_tools.harness import loop
from ckpt_tools.harness.config import TrainConfig, TrainResult
from ckpt_tools.harness.data import shard

__all__ = ["allreduce_mean_grads", "broadcast_state", "train_manual"]


def allreduce_mean_grads(replicas: Sequence[nn.Module]) -> None:
    """Average the replicas' gradients into the master's (``replicas[0]``) ``.grad``.

    Gradients are summed on the master's device in replica order, then divided by the
    replica count; a replica whose parameter got no gradient counts as zero.

    Args:
        replicas: the master first, then the other replicas, all the same architecture.

    Example:
        >>> a, b = nn.Linear(1, 1), nn.Linear(1, 1)
        >>> for m, g in ((a, 1.0), (b, 3.0)):
        ...     for p in m.parameters():
        ...         p.grad = torch.full_like(p, g)
        >>> allreduce_mean_grads([a, b]); float(a.weight.grad)
        2.0
    """
    count = len(replicas)
    per_replica = [list(r.parameters()) for r in replicas]
    for master_param, *others in zip(*per_replica, strict=True):
        total = master_param.grad
        for param in others:
            if param.grad is None:
                continue
            grad = param.grad.to(master_param.device)
            total = grad.clone() if total is None else total + grad
        if total is not None:
            master_param.grad = total / count


@torch.no_grad()
def broadcast_state(master: nn.Module, replicas: Sequence[nn.Module]) -> None:
    """Copy the master's parameters and buffers into every other replica, in place.

    Buffers too: BatchNorm running statistics follow the master's, as with
    ``nn.DataParallel``, whose device-0 replica shares the master's buffers.

    Args:
        master: the model the optimizer updates.
        replicas: models to overwrite (``master`` itself may be among them; it is skipped).

    Raises:
        ValueError: a replica has a different number of parameters or buffers.

    Example:
        >>> a, b = nn.Linear(1, 1), nn.Linear(1, 1)
        >>> broadcast_state(a, [a, b]); torch.equal(a.weight, b.weight)
        True
    """
    source = list(master.parameters()) + list(master.buffers())
    for replica in replicas:
        if replica is master:
            continue
        target = list(replica.parameters()) + list(replica.buffers())
        for dst, src in zip(target, source, strict=True):
            dst.copy_(src)


def train_manual(config: TrainConfig, devices: Sequence[torch.device]) -> TrainResult:
    """Train with the hand-written data-parallel loop over ``devices``.

    Args:
        config: the run (``world_size`` is ``len(devices)``).
        devices: one per replica; the first holds the master.

    Returns:
        The run's result; checkpoints are written when ``config.out_dir`` is set. The
        wrapped checkpoint uses the ``module.`` layout of ``nn.DataParallel``.

    Example:
        >>> config = TrainConfig(strategy="manual", steps=1)
        >>> result = train_manual(config, [torch.device("cpu")] * 2)
        >>> result.world_size, result.fallback is not None
        (2, True)
    """
    count = len(devices)
    master = loop.init_model(config).to(devices[0])
    # The master is replica 0 (as in DataParallel); the others start as exact copies.
    replicas = [master] + [copy.deepcopy(master).to(d) for d in devices[1:]]
    optimizer = loop.make_optimizer(master.parameters(), config)
    losses: list[float] = []
    with loop.deterministic():
        for images, labels in loop.global_batches(config):
            step_loss = 0.0
            for rank, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
                # scatter: this replica's contiguous slice of the global batch
                x, y = shard(images, rank, count).to(device), shard(labels, rank, count).to(device)
                replica.zero_grad(set_to_none=True)
                loss = loop.local_loss(replica(x), y, len(labels), count)
                loss.backward()
                step_loss += float(loss.detach())
            allreduce_mean_grads(replicas)
            optimizer.step()
            broadcast_state(master, replicas)
            # Each local loss is scaled by count / global batch, so their mean is the
            # global-batch mean loss, comparable with the other strategies.
            losses.append(step_loss / count)
    fallback = loop.cpu_fallback(devices, f"{count} replicas ran one after another on the CPU")
    return loop.finish_run(
        config, devices, losses, loop.ModuleContainer(master), master, optimizer, fallback
    )
