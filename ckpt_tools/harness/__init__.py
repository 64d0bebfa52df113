"""A bundled multi-GPU training harness with a CPU fallback, and checkpoint parity checks.

Trains small models (MLP, LeNet, a BatchNorm ResNet) on a synthetic Fashion-MNIST-shaped
dataset with five strategies: ``single`` device, ``dp`` (``nn.DataParallel``), ``ddp``
(DistributedDataParallel, spawned or under ``torchrun``), ``manual`` (the hand-written
data-parallel loop) and ``fsdp`` (FSDP2 ``fully_shard``, launched as ``ddp`` is, saving a DCP
folder too), saving checkpoints the way users do. :func:`run_parity` then checks
that ckpt_tools' key rewrites, device retagging and format conversion preserve them.

This subpackage is the only part of ckpt_tools that imports ``torch.distributed``.
Importing it imports neither torch nor click: the names below that need torch load on
first use, and the command line (``ckpt harness``, ``python -m ckpt_tools.harness``)
lives in :mod:`ckpt_tools.cli.commands.harness`.

Example:
    >>> from ckpt_tools.harness import TrainConfig, train
    >>> result = train(TrainConfig(strategy="manual", world_size=2, steps=2, device="cpu"))
    >>> result.devices
    ('cpu', 'cpu')
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckpt_tools.harness.config import MODEL_NAMES, STRATEGIES, TrainConfig, TrainResult
from ckpt_tools.loading.extras import require_torch

if TYPE_CHECKING:
    from ckpt_tools.harness.data import synthetic_fashion
    from ckpt_tools.harness.models import build_harness_model
    from ckpt_tools.harness.parity.checks import CHECK_NAMES, CheckResult
    from ckpt_tools.harness.parity.run import ParityReport, run_parity
    from ckpt_tools.harness.strategies import train

# Names whose modules import torch, loaded on first use.
_LAZY = {
    "CHECK_NAMES": "ckpt_tools.harness.parity.checks",
    "CheckResult": "ckpt_tools.harness.parity.checks",
    "ParityReport": "ckpt_tools.harness.parity.run",
    "build_harness_model": "ckpt_tools.harness.models",
    "run_parity": "ckpt_tools.harness.parity.run",
    "synthetic_fashion": "ckpt_tools.harness.data",
    "train": "ckpt_tools.harness.strategies",
}

__all__ = [
    "CHECK_NAMES",
    "MODEL_NAMES",
    "STRATEGIES",
    "CheckResult",
    "ParityReport",
    "TrainConfig",
    "TrainResult",
    "build_harness_model",
    "run_parity",
    "synthetic_fashion",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        require_torch(f"ckpt_tools.harness.{name}")  # one clear error when torch is missing
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpt_tools.harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
