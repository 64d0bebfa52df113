"""What a harness run is asked to do (:class:`TrainConfig`), what it did (:class:`TrainResult`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.harness.models import MODEL_NAMES

__all__ = ["CHECKPOINT_NAMES", "RUN_JSON", "STRATEGIES", "TrainConfig", "TrainResult"]

#: Training strategies, in the order reports list them.
STRATEGIES: tuple[str, ...] = ("single", "dp", "ddp", "manual")
#: The three checkpoint files every run writes into its output directory.
CHECKPOINT_NAMES: tuple[str, ...] = ("wrapped", "bare", "trainer")
#: Name of the run summary (losses, devices) written next to the checkpoints.
RUN_JSON = "run.json"
#: The fixes for a global batch smaller than the ranks it is split over.
SMALL_BATCH_REMEDIES: tuple[Remedy, ...] = (
    Remedy("batch_size", verb="raise", flag="--batch-size"),
    Remedy("world_size", verb="lower", flag="--world-size"),
)


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        strategy: ``single``, ``dp``, ``ddp`` or ``manual``.
        model: a name :func:`ckpt_tools.harness.models.build_model` knows.
        steps: number of SGD steps.
        world_size: replicas/ranks; ``None``: one per selected GPU, or 2 on the CPU.
            ``single`` always uses one device.
        batch_size: the *global* batch; DDP ranks and manual replicas each take a slice,
            so equal seeds give the same gradients as one device.
        lr: SGD learning rate.
        momentum: SGD momentum (gives the optimizer state real tensors to checkpoint).
        seed: seeds the weights, the dataset and the batch order.
        num_samples: dataset size.
        gpus: GPU selection (``"0,3"``, ``"auto:2"``, indices), see
            :func:`ckpt_tools.harness.placement.parse_gpus`.
        device: ``"cpu"`` forces the CPU.
        out_dir: where to write ``wrapped.pt``, ``bare.pt``, ``trainer.pt`` and
            ``run.json``; ``None`` writes nothing.
        model_kwargs: extra arguments for the model class, e.g. ``{"hidden": (8,)}``.
        sync_bn: use SyncBatchNorm under DDP; ``None`` means "when the model has
            BatchNorm and the ranks are GPUs" (SyncBatchNorm has no CPU implementation).
    """

    strategy: str = "single"
    model: str = "mlp"
    steps: int = 5
    world_size: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    seed: int = 0
    num_samples: int = 512
    gpus: str | tuple[int, ...] | None = None
    device: str | None = None
    out_dir: str | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    sync_bn: bool | None = None

    def validate(self) -> None:
        """Check the arguments that do not depend on the machine.

        Raises:
            UsageError: naming the bad field, what was expected and the option that fixes it.
        """
        if self.strategy not in STRATEGIES:
            raise UsageError(
                f"unknown strategy; expected one of {', '.join(STRATEGIES)}",
                argument="strategy",
                value=repr(self.strategy),
                flag="--strategy",
            )
        if self.model.lower() not in MODEL_NAMES:
            raise UsageError(
                f"unknown model; expected one of {', '.join(MODEL_NAMES)}",
                argument="model",
                value=repr(self.model),
                flag="--model",
            )
        if self.steps < 1:
            raise UsageError(
                "must be at least 1", argument="steps", value=repr(self.steps), flag="--steps"
            )
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(
                "must be at least 1",
                argument="world_size",
                value=repr(self.world_size),
                flag="--world-size",
            )
        if self.world_size is not None and self.batch_size < self.world_size:
            raise UsageError(
                f"leaves some of the {self.world_size} ranks without samples",
                argument="batch_size",
                value=repr(self.batch_size),
                flag="--batch-size",
                remedies=SMALL_BATCH_REMEDIES,
            )
        if not 1 <= self.batch_size <= self.num_samples:
            raise UsageError(
                f"must be between 1 and num_samples={self.num_samples}",
                argument="batch_size",
                value=repr(self.batch_size),
                flag="--batch-size",
            )


@dataclass(frozen=True)
class TrainResult:
    """What a run did.

    Attributes:
        strategy: the strategy that ran.
        model: the model name.
        world_size: replicas/ranks that took part (1 for ``single``).
        devices: the device of every replica/rank, e.g. ``("cpu", "cpu")``.
        losses: the global-batch mean loss of every step, before that step's update.
        steps: optimizer steps taken.
        epoch: full passes over the data completed.
        fallback: why the strategy ran differently from its GPU form, or ``None``.
        backend: the process-group backend (``gloo``/``nccl``) for DDP.
        launcher: ``in-process``, ``spawn`` or ``torchrun``.
        sync_bn: whether BatchNorm statistics were synchronised over ranks.
        out_dir: where the checkpoints are, or ``None``.
        checkpoints: checkpoint name (``wrapped``/``bare``/``trainer``) to path.
        seconds: wall time of the training itself.
    """

    strategy: str
    model: str
    world_size: int
    devices: tuple[str, ...]
    losses: tuple[float, ...]
    steps: int
    epoch: int
    fallback: str | None = None
    backend: str | None = None
    launcher: str = "in-process"
    sync_bn: bool = False
    out_dir: str | None = None
    checkpoints: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every field."""
        data = asdict(self)
        data["devices"], data["losses"] = list(self.devices), list(self.losses)
        data["checkpoints"] = dict(self.checkpoints)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainResult:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        kw["devices"] = tuple(kw.get("devices", ()))
        kw["losses"] = tuple(float(x) for x in kw.get("losses", ()))
        return cls(**kw)

    def write_json(self, out_dir: str | Path) -> Path:
        """Write :data:`RUN_JSON` into ``out_dir`` and return its path."""
        path = Path(out_dir) / RUN_JSON
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def read_json(cls, out_dir: str | Path) -> TrainResult:
        """Read the :data:`RUN_JSON` a run wrote into ``out_dir``."""
        return cls.from_dict(json.loads((Path(out_dir) / RUN_JSON).read_text(encoding="utf-8")))
