"""What a harness run is asked to do (:class:`TrainConfig`), what it did (:class:`TrainResult`).

Also the harness's name tables (:data:`STRATEGIES`, :data:`MODEL_NAMES`), the checks a
run's arguments need no machine for, and torchrun detection (:func:`torchrun_env`). This
module imports neither torch nor click, so the ``ckpt harness`` options take their
choices from here without making ``ckpt --help`` import torch.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ckpt_tools._types import one_of
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.formats.urls import refuse_url
from ckpt_tools.structure.json_values import json_ready

__all__ = [
    "CHECKPOINT_NAMES",
    "DEEPSPEED_DIR",
    "MODEL_NAMES",
    "MULTI_PROCESS",
    "RUN_JSON",
    "SEED_RANGE",
    "SPLIT_BATCH",
    "STEPS_DIR",
    "STRATEGIES",
    "TORCHRUN_VARS",
    "ZERO_STAGES",
    "TorchrunEnv",
    "TrainConfig",
    "TrainResult",
    "check_batch_covers",
    "check_model_name",
    "check_torchrun_fit",
    "torchrun_env",
]

#: Training strategies, in the order reports list them.
STRATEGIES: tuple[str, ...] = ("single", "dp", "ddp", "manual", "fsdp", "zero")
#: The strategies that run one process per rank (spawned, or under torchrun).
MULTI_PROCESS: tuple[str, ...] = ("ddp", "fsdp", "zero")
#: The strategies that split every global batch over ``world_size`` ranks or replicas.
SPLIT_BATCH: tuple[str, ...] = ("manual", *MULTI_PROCESS)
#: The seeds ``torch.manual_seed`` accepts, both ends included.
SEED_RANGE: tuple[int, int] = (-(2**63), 2**64 - 1)
#: The ZeRO stages the ``zero`` strategy trains with; 3 (parameters, gradients and optimizer
#: states all partitioned, FSDP's counterpart) unless asked otherwise.
ZERO_STAGES: tuple[int, ...] = (1, 2, 3)
#: The folder of a ``zero`` run's ``out_dir`` that ``engine.save_checkpoint`` writes.
DEEPSPEED_DIR = "deepspeed"
#: Every model :func:`ckpt_tools.harness.models.build_harness_model` builds; ``resnet-syncbn``
#: is the ResNet with SyncBatchNorm.
MODEL_NAMES: tuple[str, ...] = ("mlp", "lenet", "resnet", "resnet-syncbn")


def check_model_name(name: str, *, argument: str) -> str:
    """``name``'s key in :data:`MODEL_NAMES` (case aside).

    Raises:
        UsageError: ``name`` is not a known model; ``argument`` names what was passed.

    Example:
        >>> check_model_name("MLP", argument="model")
        'mlp'
    """
    key = name.lower()
    if key not in MODEL_NAMES:
        one_of(name, MODEL_NAMES, argument, flag="--arch")  # refused as the caller spelled it
    return key


#: The three checkpoint files every run writes into its output directory.
CHECKPOINT_NAMES: tuple[str, ...] = ("wrapped", "bare", "trainer")
#: Name of the run summary (losses, devices) written next to the checkpoints.
RUN_JSON = "run.json"
#: The folder of a run's ``out_dir`` that ``record_steps`` fills: ``00001.pt`` ... one file per
#: optimizer step, the list of the model's parameters after that step.
STEPS_DIR = "steps"
#: Environment variables torchrun sets for every worker; all present means "under torchrun".
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
#: The largest float32 (torch.finfo(torch.float32).max): the largest learning rate SGD applies.
_FLOAT32_MAX = 3.4028234663852886e38
#: The fixes for a global batch smaller than the ranks it is split over.
SMALL_BATCH_REMEDIES: tuple[Remedy, ...] = (
    Remedy("batch_size", verb="raise", flag="--batch-size"),
    Remedy("world_size", verb="lower", flag="--world-size"),
)


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Attributes:
        strategy: ``single``, ``dp``, ``ddp``, ``manual``, ``fsdp`` or ``zero`` (DeepSpeed).
        model: one of :data:`MODEL_NAMES`.
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
        record_steps: also save the parameters after every step into ``out_dir/``
            :data:`STEPS_DIR` (the parity plot's per-step weight differences); needs
            ``out_dir``.
        zero_stage: the ZeRO stage of the ``zero`` strategy, one of :data:`ZERO_STAGES`.
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
    record_steps: bool = False
    zero_stage: int = 3

    def validate(self) -> None:
        """Check the arguments that do not depend on the machine.

        Raises:
            UsageError: naming the bad field, what was expected and the option that fixes it.
        """
        self._validate_names()
        if self.steps < 1:
            raise UsageError(
                "must be at least 1", argument="steps", value=repr(self.steps), flag="--steps"
            )
        if not (math.isfinite(self.lr) and 0 < self.lr <= _FLOAT32_MAX):
            # SGD steps in float32: a rate past its range cannot even be applied.
            raise UsageError(
                "must be a positive number float32 holds (at most 3.4e38)",
                argument="lr",
                value=repr(self.lr),
                flag="--lr",
            )
        if self.world_size is not None and self.world_size < 1:
            raise UsageError(
                "must be at least 1",
                argument="world_size",
                value=repr(self.world_size),
                flag="--world-size",
            )
        if self.world_size is not None and self.strategy in SPLIT_BATCH:
            # single trains on one device whatever world_size says; dp splits the batch
            # only over GPUs, which train() checks once it knows the devices.
            what = "replicas" if self.strategy == "manual" else "ranks"
            check_batch_covers(self.batch_size, self.world_size, what)
        if self.out_dir is not None:
            refuse_url(self.out_dir, output=True)
        if self.record_steps and self.out_dir is None:
            raise UsageError(
                "needs out_dir: the parameters of every step are saved there",
                argument="record_steps",
                value="True",
            )
        if not 1 <= self.batch_size <= self.num_samples:
            raise UsageError(
                f"must be between 1 and num_samples={self.num_samples}",
                argument="batch_size",
                value=repr(self.batch_size),
                flag="--batch-size",
            )
        self._validate_seed()

    def _validate_names(self) -> None:
        """The strategy, the model and the ZeRO stage are among the known ones."""
        one_of(self.strategy, STRATEGIES, "strategy", flag="--strategy")
        check_model_name(self.model, argument="model")
        one_of(self.zero_stage, ZERO_STAGES, "zero_stage", flag="--zero-stage")

    def _validate_seed(self) -> None:
        """Every seed the run draws is one torch accepts: the data order of epoch ``e`` is
        seeded with ``seed + e`` (:func:`ckpt_tools.harness.data.batch_indices`)."""
        last_epoch = (self.steps - 1) // (self.num_samples // self.batch_size)
        low, high = SEED_RANGE[0], SEED_RANGE[1] - last_epoch
        if low <= self.seed <= high:
            return
        why = "the seeds torch accepts"
        if last_epoch:
            epochs = f"{last_epoch} epoch{'s' if last_epoch > 1 else ''}"
            why += f", less the {epochs} that {self.steps} steps add to it for the data order"
        raise UsageError(
            f"must be between {low} and {high} ({why})",
            argument="seed",
            value=repr(self.seed),
            flag="--seed",
        )


def check_batch_covers(
    batch_size: int, ranks: int, what: str, remedies: tuple[Remedy, ...] = SMALL_BATCH_REMEDIES
) -> None:
    """Refuse a global batch too small to give each rank or replica a sample.

    Args:
        batch_size: the global batch.
        ranks: how many ranks or replicas split it.
        what: what they are called in the message (``"ranks"``, ``"replicas"``).
        remedies: the fixes to suggest.

    Raises:
        UsageError: ``batch_size < ranks``, naming ``batch_size`` and the fixes.

    Example:
        >>> check_batch_covers(2, 4, "ranks")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: batch_size=2: leaves some of the 4 ranks without samples; ...
    """
    if batch_size < ranks:
        raise UsageError(
            f"leaves some of the {ranks} {what} without samples",
            argument="batch_size",
            value=repr(batch_size),
            flag="--batch-size",
            remedies=remedies,
        )


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

    Raises:
        UsageError: a rank variable that is not a whole number >= 0 (a launcher sets them so).

    Example:
        >>> torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...               "MASTER_ADDR": "127.0.0.1"}).rank
        1
    """
    env = os.environ if environ is None else environ
    if not all(env.get(name) for name in TORCHRUN_VARS):
        return None
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        text = env.get(name, env["WORLD_SIZE"])  # LOCAL_WORLD_SIZE: one node by default
        if not text.isascii() or not text.isdigit():
            raise UsageError(
                f"the environment variable {name}={text!r} is not a whole number; torchrun "
                "sets the rank variables, unset them to run without it"
            )
        numbers[name] = int(text)
    return TorchrunEnv(
        rank=numbers["RANK"],
        world_size=numbers["WORLD_SIZE"],
        local_rank=numbers["LOCAL_RANK"],
        local_world_size=numbers["LOCAL_WORLD_SIZE"],
    )


def check_torchrun_fit(config: TrainConfig, env: TorchrunEnv) -> None:
    """Refuse a run that cannot be one of torchrun's ranks, before any process group.

    Args:
        config: the run each rank was started with.
        env: the worker's rendezvous variables (:func:`torchrun_env`).

    Raises:
        UsageError: a one-process strategy (every rank would train alone and all would
            write ``out_dir``), or a ``world_size`` other than torchrun's.

    Example:
        >>> env = TorchrunEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
        >>> check_torchrun_fit(TrainConfig(strategy="ddp"), env)
    """
    if config.strategy not in MULTI_PROCESS:
        message = f"runs in one process, but torchrun started {env.world_size}"
        argument, value, flag = "strategy", repr(config.strategy), "--strategy"
        remedies = (
            Remedy("strategy", "'ddp'", flag="--strategy ddp", verb="use"),
            Remedy(text="run without torchrun"),
        )
    elif config.world_size not in (None, env.world_size):
        message = f"torchrun started {env.world_size} processes"
        argument, value, flag = "world_size", repr(config.world_size), "--world-size"
        remedies = (
            Remedy("world_size", verb="drop", flag="--world-size"),
            Remedy(text="match torchrun's --nproc-per-node"),
        )
    else:
        return
    raise UsageError(message, argument=argument, value=value, flag=flag, remedies=remedies)


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
        checkpoints: checkpoint name (``wrapped``/``bare``/``trainer``) to path; ``fsdp``
            runs add ``dcp``, the folder ``torch.distributed.checkpoint.save`` wrote.
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

    def to_json(self) -> dict[str, Any]:
        """What ``--json`` prints: every field, JSON-ready (a loss that is not finite as its
        name, which :meth:`from_json` reads back)."""
        data = asdict(self)
        data["devices"], data["losses"] = list(self.devices), list(self.losses)
        data["checkpoints"] = dict(self.checkpoints)
        return json_ready(data)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainResult:
        """Inverse of :meth:`to_json` (the mapping, parsed); unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        kw["devices"] = tuple(kw.get("devices", ()))
        kw["losses"] = tuple(float(x) for x in kw.get("losses", ()))
        return cls(**kw)

    def write_json(self, out_dir: str | Path) -> Path:
        """Write :data:`RUN_JSON` into ``out_dir`` and return its path."""
        from ckpt_tools.harness.outputs import write_whole  # (it reads this module's names)

        path = Path(out_dir) / RUN_JSON
        text = json.dumps(self.to_json(), indent=2, allow_nan=False)
        write_whole((text + "\n").encode(), path)
        return path

    @classmethod
    def read_json(cls, out_dir: str | Path) -> TrainResult:
        """Read the :data:`RUN_JSON` a run wrote into ``out_dir``."""
        return cls.from_json(json.loads((Path(out_dir) / RUN_JSON).read_text(encoding="utf-8")))
