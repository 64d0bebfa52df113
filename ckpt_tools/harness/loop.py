"""Pieces every strategy shares: seeding, the batches, the loss, the optimizer, the result.

Keeping them in one place is what makes the strategies comparable: they differ only in
how a global batch is spread over devices, never in the maths of a step.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ckpt_tools.harness.config import CHECKPOINT_NAMES, STEPS_DIR, TrainConfig, TrainResult
from ckpt_tools.harness.data import batch_indices, steps_per_epoch, synthetic_fashion
from ckpt_tools.harness.models import build_harness_model
from ckpt_tools.harness.outputs import write_whole

__all__ = [
    "ModuleContainer",
    "StepRecorder",
    "completed_epochs",
    "cpu_fallback",
    "deterministic",
    "finish_run",
    "global_batches",
    "init_model",
    "local_loss",
    "make_optimizer",
    "save_checkpoints",
]


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Run the body with ``torch.use_deterministic_algorithms(True)``, then restore.

    ``warn_only=True`` because on CUDA some kernels (cuBLAS without
    ``CUBLAS_WORKSPACE_CONFIG``) would otherwise raise; they still compute correctly, and
    parity is judged against a tolerance there anyway. The caller's setting comes back
    afterwards so the library leaves no global state behind.

    Example:
        >>> with deterministic():
        ...     torch.are_deterministic_algorithms_enabled()
        True
    """
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def init_model(config: TrainConfig, sync_bn: bool = False) -> nn.Module:
    """Build ``config.model`` with weights drawn from ``config.seed``.

    The global RNG is forked, so the caller's random state is untouched, and every
    process that calls this with the same config gets bit-identical weights.

    Args:
        config: the run; ``model``, ``model_kwargs`` and ``seed`` are used.
        sync_bn: convert BatchNorm to SyncBatchNorm.

    Returns:
        The model on the CPU, in training mode.

    Example:
        >>> a = init_model(TrainConfig(model="mlp"))
        >>> b = init_model(TrainConfig(model="mlp"))
        >>> all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
        True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return build_harness_model(config.model, sync_bn=sync_bn, **dict(config.model_kwargs))


def global_batches(config: TrainConfig) -> Iterator[tuple[Tensor, Tensor]]:
    """The images and labels of every step's global batch, in step order.

    Every strategy and every process draws the same batches (see
    :func:`ckpt_tools.harness.data.batch_indices`); replicas and ranks take their part
    with :func:`ckpt_tools.harness.data.shard`.

    Args:
        config: the run; ``steps``, ``num_samples``, ``batch_size`` and ``seed`` are used.

    Returns:
        An iterator of ``(images, labels)`` pairs on the CPU, one per step.

    Example:
        >>> images, labels = next(global_batches(TrainConfig(batch_size=8)))
        >>> tuple(images.shape), tuple(labels.shape)
        ((8, 1, 28, 28), (8,))
    """
    images, labels = synthetic_fashion(config.num_samples, config.seed).tensors
    for step in range(config.steps):
        idx = batch_indices(step, config.num_samples, config.batch_size, config.seed)
        yield images[idx], labels[idx]


def local_loss(logits: Tensor, targets: Tensor, global_batch: int, world_size: int) -> Tensor:
    """One replica's share of the loss, scaled so that *averaging* gradients is exact.

    The sum of per-sample losses over the replica's shard, times ``world_size /
    global_batch``: averaging these gradients over ``world_size`` replicas (what DDP and
    the manual all-reduce do) gives exactly the gradient of the global-batch mean loss,
    even when shards differ in size by one. With one replica it is the plain mean.

    Args:
        logits: ``[shard, classes]``.
        targets: ``[shard]`` class indices.
        global_batch: size of the whole batch over all replicas.
        world_size: number of replicas.

    Returns:
        A scalar tensor.

    Example:
        >>> logits, targets = torch.zeros(4, 10), torch.zeros(4, dtype=torch.long)
        >>> mean = nn.functional.cross_entropy(logits, targets)
        >>> float(local_loss(logits, targets, 4, 1)) == float(mean)
        True
    """
    total = nn.functional.cross_entropy(logits, targets, reduction="sum")
    return total * (world_size / global_batch)


class StepRecorder:
    """An optimizer step hook that saves the parameters after every step.

    Step ``n`` goes to ``out_dir/steps/0000n.pt`` as the list of parameters in the
    optimizer's order (the model's own order in every strategy), on the CPU. Parameters
    sharded by FSDP are gathered first, which every rank takes part in; in a process group
    only rank 0 writes.

    Args:
        out_dir: the run's output folder.

    Example:
        >>> model = nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> _ = optimizer.register_step_post_hook(StepRecorder("out"))
        >>> model(torch.ones(1, 2)).sum().backward(); optimizer.step()
        >>> len(torch.load("out/steps/00001.pt", weights_only=True))
        2
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.folder = Path(out_dir) / STEPS_DIR
        self.step = 0

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step += 1
        params = [p for group in optimizer.param_groups for p in group["params"]]
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_rank() != 0:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        saved = [t.detach().to("cpu", copy=True) for t in full]
        save_whole(saved, self.folder / f"{self.step:05d}.pt")


def make_optimizer(params: Iterable[nn.Parameter], config: TrainConfig) -> torch.optim.SGD:
    """SGD with the run's learning rate and momentum.

    ``foreach=False``: the plain per-parameter loop, so the update is the same code path
    on every device and in every process. With ``config.record_steps``, a
    :class:`StepRecorder` saves the parameters after each step.

    Args:
        params: parameters to optimise.
        config: the run; ``lr``, ``momentum``, ``record_steps`` and ``out_dir`` are used.

    Returns:
        The optimizer.

    Example:
        >>> make_optimizer(nn.Linear(2, 2).parameters(), TrainConfig()).defaults["momentum"]
        0.9
    """
    optimizer = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, foreach=False)
    if config.record_steps and config.out_dir is not None:
        optimizer.register_step_post_hook(StepRecorder(config.out_dir))
    return optimizer


def completed_epochs(config: TrainConfig) -> int:
    """Full passes over the data after ``config.steps`` steps (the trainer dict's ``epoch``).

    Args:
        config: the run; ``steps``, ``num_samples`` and ``batch_size`` are used.

    Returns:
        ``steps // (num_samples // batch_size)``.

    Example:
        >>> completed_epochs(TrainConfig(steps=40, num_samples=512, batch_size=32))
        2
    """
    return config.steps // steps_per_epoch(config.num_samples, config.batch_size)


class ModuleContainer(nn.Module):
    """Holds a model as ``.module``, giving ``nn.DataParallel``'s ``module.`` key layout.

    ``nn.DataParallel(model)`` moves the model to ``cuda:0`` when exactly one GPU is
    visible; this container never touches devices, so the single and manual strategies
    can save a DataParallel-style checkpoint of a model wherever it lives.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def save_checkpoints(
    out_dir: str | Path,
    wrapped_sd: Mapping[str, Any],
    bare_sd: Mapping[str, Any],
    optimizer_sd: Mapping[str, Any],
    config: TrainConfig,
) -> dict[str, str]:
    """Write ``wrapped.pt``, ``bare.pt`` and ``trainer.pt`` the way training scripts do.

    Plain ``torch.save`` (zip format), tensors left on whatever device they live on, as a
    user saving from a GPU would.

    Args:
        out_dir: created if missing.
        wrapped_sd: the wrapped model's state dict (``module.`` keys).
        bare_sd: the unwrapped model's state dict.
        optimizer_sd: the optimizer's state dict, for the trainer dict.
        config: the run, for ``epoch`` and ``step``.

    Returns:
        ``{"wrapped": path, "bare": path, "trainer": path}``.

    Raises:
        OSError: the directory or a file cannot be written.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> opt = make_optimizer(model.parameters(), TrainConfig())
        >>> sorted(save_checkpoints("out", ModuleContainer(model).state_dict(),
        ...                         model.state_dict(), opt.state_dict(), TrainConfig()))
        ['bare', 'trainer', 'wrapped']
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = {
        "model": bare_sd,
        "optimizer": optimizer_sd,
        "epoch": completed_epochs(config),
        "step": config.steps,
    }
    paths = {name: out / f"{name}.pt" for name in CHECKPOINT_NAMES}
    save_whole(wrapped_sd, paths["wrapped"])
    save_whole(bare_sd, paths["bare"])
    save_whole(trainer, paths["trainer"])
    return {name: str(path) for name, path in paths.items()}


def save_whole(obj: Any, path: Path) -> None:
    """``torch.save``'s bytes written by us, renamed into place once whole
    (:func:`~ckpt_tools.harness.outputs.write_whole`): torch's own writer raises RuntimeError
    for a full disk and leaves part of the file. The harness's models are small."""
    serialized = io.BytesIO()
    torch.save(obj, serialized)
    write_whole(serialized.getbuffer(), path)


def cpu_fallback(devices: Sequence[torch.device], what: str) -> str | None:
    """A run's ``fallback`` when it ran on the CPU only: why, then what ran instead.

    Args:
        devices: the devices the run used.
        what: what ran in place of the GPU form, e.g. ``"2 CPU processes over gloo"``.

    Returns:
        ``None`` when some device is a GPU; else ``"no GPU: ..."``, or
        ``"device='cpu': ..."`` when GPUs were there but not used.

    Example:
        >>> cpu_fallback([torch.device("cuda", 0)], "2 CPU processes over gloo") is None
        True
    """
    if any(d.type != "cpu" for d in devices):
        return None
    why = "device='cpu'" if torch.cuda.is_available() else "no GPU"
    return f"{why}: {what}"


def finish_run(
    config: TrainConfig,
    devices: Sequence[torch.device],
    losses: Sequence[float],
    wrapped: nn.Module,
    bare: nn.Module,
    optimizer: torch.optim.Optimizer,
    fallback: str | None,
    *,
    save: bool = True,
    written: Mapping[str, str] | None = None,
) -> TrainResult:
    """Save a finished run's checkpoints (when it has an ``out_dir``) and describe it.

    Args:
        config: the run.
        devices: the device of every replica.
        losses: the global-batch loss of every step.
        wrapped: the model with the ``module.`` key layout.
        bare: the unwrapped model.
        optimizer: its state goes into ``trainer.pt``.
        fallback: how the run differed from its GPU form, or ``None``.
        save: ``False`` for the DDP ranks that leave the writing to rank 0.
        written: the checkpoints the caller wrote itself (sharded saves, where every rank
            writes its part): nothing is saved here, and these are the result's files.

    Returns:
        The result; ``out_dir`` and ``checkpoints`` are set when files were written.

    Raises:
        OSError: a checkpoint cannot be written.

    Example:
        >>> model = init_model(TrainConfig())
        >>> optimizer = make_optimizer(model.parameters(), TrainConfig())
        >>> cpu = [torch.device("cpu")]
        >>> run = finish_run(TrainConfig(), cpu, [2.3], model, model, optimizer, None)
        >>> run.world_size, run.checkpoints
        (1, {})
    """
    checkpoints = dict(written) if written is not None else {}
    if written is None and save and config.out_dir is not None:
        checkpoints = save_checkpoints(
            config.out_dir, wrapped.state_dict(), bare.state_dict(), optimizer.state_dict(), config
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
        out_dir=str(config.out_dir) if checkpoints else None,
        checkpoints=checkpoints,
    )
