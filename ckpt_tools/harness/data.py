"""A deterministic synthetic dataset shaped like Fashion-MNIST, and the batch schedule.

Nothing is downloaded: images are class prototypes plus noise drawn from a seeded
:class:`torch.Generator`, so every process (a spawned DDP rank, a ``torchrun`` worker, the
parent) rebuilds bit-identical data from the seed alone, and nothing has to be shipped
between processes.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from ckpt_tools.errors import UsageError

__all__ = ["batch_indices", "shard", "steps_per_epoch", "synthetic_fashion"]


def synthetic_fashion(num_samples: int = 512, seed: int = 0) -> TensorDataset:
    """Build a Fashion-MNIST-shaped dataset: float images 1x28x28 in [0, 1], 10 classes.

    Each class has a random prototype image; a sample is its class prototype plus noise,
    so the models can actually learn something in a few steps and losses go down.

    Args:
        num_samples: number of samples.
        seed: seed of the generator; equal seeds give bit-identical datasets.

    Returns:
        ``TensorDataset(images, labels)``: images ``float32 [N, 1, 28, 28]``, labels
        ``int64 [N]``.

    Raises:
        UsageError: ``num_samples`` is not positive.

    Example:
        >>> images, labels = synthetic_fashion(8).tensors
        >>> tuple(images.shape), labels.dtype
        ((8, 1, 28, 28), torch.int64)
    """
    if num_samples < 1:
        raise UsageError(f"num_samples must be at least 1, got {num_samples}")
    # A CPU generator: its stream is the same on every machine, unlike a CUDA one.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prototypes = torch.rand(10, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (num_samples,), generator=gen)
    noise = torch.rand(num_samples, 1, 28, 28, generator=gen)
    images = (0.7 * prototypes[labels] + 0.3 * noise).clamp_(0.0, 1.0)
    return TensorDataset(images, labels)


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Number of full global batches in one pass over the data (the last partial one is dropped).

    Args:
        num_samples: dataset size.
        batch_size: global batch size.

    Returns:
        ``num_samples // batch_size``.

    Raises:
        UsageError: the batch is larger than the dataset, or not positive.

    Example:
        >>> steps_per_epoch(512, 32)
        16
    """
    if batch_size < 1 or batch_size > num_samples:
        raise UsageError(
            f"batch_size must be between 1 and the dataset size {num_samples}, got {batch_size}"
        )
    return num_samples // batch_size


def batch_indices(step: int, num_samples: int, batch_size: int, seed: int) -> Tensor:
    """Sample indices of the global batch for optimizer step ``step``.

    Every strategy draws the same indices for the same step: the order is a permutation
    seeded with ``seed + epoch``, so it depends on nothing but these arguments.

    Args:
        step: zero-based optimizer step.
        num_samples: dataset size.
        batch_size: global batch size (summed over all replicas/ranks).
        seed: data-order seed.

    Returns:
        ``int64`` tensor of ``batch_size`` indices.

    Raises:
        UsageError: see :func:`steps_per_epoch`.

    Example:
        >>> bool((batch_indices(0, 64, 8, 0) == batch_indices(0, 64, 8, 0)).all())
        True
    """
    per_epoch = steps_per_epoch(num_samples, batch_size)
    epoch, within = divmod(step, per_epoch)
    gen = torch.Generator(device="cpu").manual_seed(seed + epoch)
    order = torch.randperm(num_samples, generator=gen)
    return order[within * batch_size : (within + 1) * batch_size]


def shard(indices: Tensor, rank: int, world_size: int) -> Tensor:
    """The contiguous part of a global batch that replica/rank ``rank`` processes.

    ``torch.tensor_split`` semantics: sizes differ by at most one when the batch does not
    divide evenly; the harness's loss scaling keeps the averaged gradient exact anyway.

    Args:
        indices: the global batch's indices.
        rank: which part, ``0 <= rank < world_size``.
        world_size: number of parts.

    Returns:
        A view of ``indices``.

    Example:
        >>> shard(torch.arange(5), 1, 2).tolist()
        [3, 4]
    """
    return torch.tensor_split(indices, world_size)[rank]
