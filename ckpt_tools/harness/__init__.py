"""A bundled multi-GPU training harness with a CPU fallback, and checkpoint parity checks.

Trains small models (MLP, LeNet, a BatchNorm ResNet) on a synthetic Fashion-MNIST-shaped
dataset with four strategies: ``single`` device, ``dp`` (``nn.DataParallel``), ``ddp``
(DistributedDataParallel, spawned or under ``torchrun``) and ``manual`` (the hand-written
data-parallel loop), saving checkpoints the way users do. :func:`run_parity` then checks
that ckpt_tools' key rewrites, device retagging and format conversion preserve them.

This subpackage is the only part of ckpt_tools that imports ``torch.distributed``.

Example:
    >>> from ckpt_tools.harness import TrainConfig, train
    >>> result = train(TrainConfig(strategy="manual", world_size=2, steps=2, device="cpu"))
    >>> result.devices
    ('cpu', 'cpu')
"""

from __future__ import annotations

from ckpt_tools.harness.checks import CHECK_NAMES, CheckResult
from ckpt_tools.harness.config import STRATEGIES, TrainConfig, TrainResult
from ckpt_tools.harness.data import synthetic_fashion
from ckpt_tools.harness.models import MODEL_NAMES, build_model
from ckpt_tools.harness.parity import ParityReport, run_parity
from ckpt_tools.harness.strategies import train

__all__ = [
    "CHECK_NAMES",
    "MODEL_NAMES",
    "STRATEGIES",
    "CheckResult",
    "ParityReport",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "run_parity",
    "synthetic_fashion",
    "train",
]
