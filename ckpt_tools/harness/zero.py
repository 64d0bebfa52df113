"""DeepSpeed ZeRO: the harness's ``zero`` strategy, and ZeRO checkpoints made by real training,
on CPU processes (gloo) or GPUs.

:func:`train_zero` is the ``zero`` strategy (``ckpt harness train --strategy zero``), launched
as ``ddp`` is (:func:`ckpt_tools.harness.ddp.launch`: spawned here, or as one rank under
``torchrun``): the harness model and its SGD optimizer trained by a DeepSpeed engine at
``config.zero_stage``, each rank on its slice of the global batch, then saved with
``engine.save_checkpoint`` into ``out_dir/deepspeed/``. Rank 0 then writes ``bare.pt`` as
``ckpt consolidate`` writes that folder (torch-free), ``wrapped.pt`` (its keys with
``module.``) and ``zero_to_fp32.pt``, DeepSpeed's own consolidation of the same folder. The
optimizer state stays in the DeepSpeed folder: a ``zero`` run writes no ``trainer.pt``.

:func:`make_zero_checkpoints` starts ``world_size`` ranks under ``torchrun`` and each rank
runs :func:`main`: one process group for every run it is given, and for each run a fresh
:class:`ZeroNet` trained for a few steps by a DeepSpeed engine at the run's ZeRO stage and
dtype, then saved with ``engine.save_checkpoint`` into ``out/<run name>/``; rank 0 may then
save DeepSpeed's own ``zero_to_fp32`` state dict of each saved tag (:func:`reference_path`),
the oracle a consolidation is compared with. Running several runs in one launch pays for
the interpreters and DeepSpeed's import once.

The model holds what a ZeRO checkpoint must carry besides plain weights: a frozen
parameter, a tied (shared) parameter and BatchNorm buffers (float and integer).

On the CPU, DeepSpeed's shared-memory communication op is turned off before the process
group starts (it would be compiled on first use, which needs a compiler), fp16 is let
through the accelerator's check (DeepSpeed's CPU accelerator refuses it, yet trains and
saves it), and each rank leaves with ``os._exit`` once the process group is gone: DeepSpeed's
threads can abort the interpreter's own exit after a complete save.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ckpt_tools.errors import MissingExtraError, UsageError
from ckpt_tools.harness import loop
from ckpt_tools.harness.config import DEEPSPEED_DIR, STEPS_DIR, TrainConfig, TrainResult
from ckpt_tools.harness.data import shard

__all__ = [
    "ZERO_DTYPES",
    "ZERO_TO_FP32",
    "ZeroLaunch",
    "ZeroNet",
    "ZeroRun",
    "deepspeed_config",
    "main",
    "make_zero_checkpoints",
    "reference_path",
    "start_zero_runs",
    "train_zero",
    "zero_missing",
]

#: The file of a ``zero`` run's ``out_dir`` that holds ``zero_to_fp32``'s state dict.
ZERO_TO_FP32 = "zero_to_fp32.pt"

#: Training dtypes a run may ask for.
ZERO_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")

#: Vocabulary and width of :class:`ZeroNet`: odd sizes, so that no parameter splits evenly
#: over the ranks and every rank's partition needs padding.
VOCAB, WIDTH = 13, 7


@dataclass(frozen=True)
class ZeroRun:
    """One DeepSpeed training run and its checkpoint.

    Attributes:
        name: the folder under the output directory that ``save_checkpoint`` writes to.
        stage: the ZeRO stage (0 to 3).
        dtype: ``fp32``, ``bf16`` or ``fp16`` training.
        steps: optimizer steps before the save.
        tag: the checkpoint's tag (None: DeepSpeed's ``global_step{N}``).
        sub_group_size: ZeRO-3's flat sub-group size in elements (small values split the
            fp32 partition of every rank into several flat groups).
        parameter_alignment: stage 1/2's per-parameter alignment padding.
        saves: how many of the last steps end with a save (each under its own tag, so
            ``saves=2`` leaves an older tag beside the one ``latest`` names).
        seed: seeds the weights and the batches.
        width: :class:`ZeroNet`'s width (its parameters grow with its square: 4096 gives
            about 67M, 268 MB in fp32).
        fp32_grads: accumulate 16-bit gradients in fp32 (``data_types.grad_accum_dtype``):
            with bf16 at stage 1, DeepSpeed then trains with its separate bf16 optimizer.
    """

    name: str
    stage: int
    dtype: str = "fp32"
    steps: int = 2
    tag: str | None = None
    sub_group_size: int | None = None
    parameter_alignment: bool = False
    saves: int = 1
    seed: int = 0
    width: int = WIDTH
    fp32_grads: bool = False

    @property
    def zero_to_fp32_reads(self) -> bool:
        """Whether DeepSpeed's ``zero_to_fp32`` reads this run's checkpoint: it refuses
        ZeRO-0 and the bf16 optimizer's files (bf16 at stage 1 with fp32 gradients).

        Example:
            >>> ZeroRun("r", stage=0).zero_to_fp32_reads, ZeroRun("r", stage=3).zero_to_fp32_reads
            (False, True)
        """
        bf16_optimizer = self.stage == 1 and self.dtype == "bf16" and self.fp32_grads
        return self.stage > 0 and not bf16_optimizer

    def validate(self) -> None:
        """Check the run's arguments.

        Raises:
            UsageError: an unknown stage or dtype, or no steps.

        Example:
            >>> ZeroRun("r", stage=4).validate()
            Traceback (most recent call last):
            ...
            ckpt_tools.errors.UsageError: stage=4: ZeRO has stages 0 to 3
        """
        if self.stage not in (0, 1, 2, 3):
            raise UsageError("ZeRO has stages 0 to 3", argument="stage", value=self.stage)
        if self.dtype not in ZERO_DTYPES:
            raise UsageError(
                f"expected one of {', '.join(ZERO_DTYPES)}", argument="dtype", value=self.dtype
            )
        if self.steps < 1:
            raise UsageError("must be at least 1", argument="steps", value=self.steps)
        if not 1 <= self.saves <= self.steps or (self.tag is not None and self.saves > 1):
            raise UsageError(
                "must be between 1 and steps (1 with a tag)", argument="saves", value=self.saves
            )


class ZeroNet(nn.Module):
    """A small token model: embedding, BatchNorm, a frozen projection, a tied output head.

    ``head.weight`` is ``embed.weight`` (tied), ``frozen`` never trains, and ``norm`` has
    float running statistics and an integer ``num_batches_tracked``.

    Args:
        width: the embedding's width; the hidden layer is ``2 * width + 1`` wide.
    """

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.norm = nn.BatchNorm1d(width)
        self.hidden = nn.Linear(width, 2 * width + 1)
        self.frozen = nn.Linear(2 * width + 1, width)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.norm(self.embed(tokens))
        x = self.frozen(torch.relu(self.hidden(x)))
        return self.head(x)


def deepspeed_config(run: ZeroRun, batch_size: int) -> dict[str, Any]:
    """The DeepSpeed config of ``run`` for a global batch of ``batch_size``.

    Args:
        run: the run.
        batch_size: the global batch (``train_batch_size``), over every rank.

    Returns:
        The config dict ``deepspeed.initialize`` takes.

    Example:
        >>> deepspeed_config(ZeroRun("r", stage=2, dtype="bf16"), 8)["bf16"]
        {'enabled': True}
    """
    zero: dict[str, Any] = {"stage": run.stage}
    if run.stage == 3 and run.sub_group_size is not None:
        zero["sub_group_size"] = run.sub_group_size
    config: dict[str, Any] = {
        "train_batch_size": batch_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if run.parameter_alignment:
        config["zero_optimization"]["parameter_alignment"] = True
    if run.dtype != "fp32":
        # 16-bit training casts parameters, not buffers: BatchNorm's would stay fp32.
        config["data_types"] = {"buffer_dtype": run.dtype}
        config[run.dtype] = {"enabled": True}
    if run.dtype == "fp16":
        config["fp16"]["initial_scale_power"] = 8
    if run.fp32_grads:
        config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    return config


def _train_and_save(run: ZeroRun, out: Path, rank: int, world: int) -> list[str]:
    """One run on this rank: a fresh engine, ``run.steps`` steps, the saves (collective).

    Returns the tags saved, oldest first.
    """
    import deepspeed

    torch.manual_seed(run.seed)
    model = ZeroNet(run.width)
    batch = 4 * world
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(run, batch),
    )
    generator = torch.Generator().manual_seed(run.seed + 1)
    tags = []
    for step in range(1, run.steps + 1):
        tokens = torch.randint(0, VOCAB, (batch,), generator=generator)
        mine = tokens[rank * 4 : (rank + 1) * 4].to(engine.device)
        loss = nn.functional.cross_entropy(engine(mine).float(), mine)
        engine.backward(loss)
        engine.step()
        if step > run.steps - run.saves:
            tag = run.tag or f"global_step{step}"
            engine.save_checkpoint(str(out / run.name), tag=tag)
            tags.append(tag)
    engine.destroy()
    return tags


def _allow_cpu_fp16() -> None:
    """DeepSpeed's CPU accelerator refuses fp16 by its own check, yet trains and saves it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        type(accelerator).is_fp16_supported = lambda self: True


def reference_path(out: str | os.PathLike[str], name: str, tag: str) -> Path:
    """Where :func:`main` saves ``zero_to_fp32``'s state dict of run ``name``'s ``tag``.

    Args:
        out: the folder of the launch's save folders.
        name: the run's name.
        tag: the saved tag.

    Returns:
        ``out/<name>-<tag>.zero_to_fp32.pt``.

    Example:
        >>> str(reference_path("o", "s2", "global_step2"))
        'o/s2-global_step2.zero_to_fp32.pt'
    """
    return Path(out) / f"{name}-{tag}.zero_to_fp32.pt"


def _save_references(out: Path, name: str, tags: Sequence[str]) -> None:
    """DeepSpeed's own consolidation of every saved tag, as ``torch.save`` files."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for tag in tags:
        state = get_fp32_state_dict_from_zero_checkpoint(str(out / name), tag=tag)
        torch.save(state, reference_path(out, name, tag))


def main(argv: Sequence[str]) -> None:
    """One rank's work under torchrun.

    Args:
        argv: ``[out_dir, runs_json, references]``: the folder, the runs as a JSON list of
            :class:`ZeroRun` fields, and ``"1"`` to save the references.

    Trains and saves every run in turn; with ``references`` = ``"1"``, rank 0 then saves
    ``zero_to_fp32``'s state dict of each saved tag (:func:`reference_path`) of the runs it
    reads. Leaves the process with ``os._exit``.
    """
    out, runs = Path(argv[0]), [ZeroRun(**r) for r in json.loads(argv[1])]
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist

    # Off before the process group starts: it would be compiled (c++, ninja) on first use.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    _allow_cpu_fp16()
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {run.name: _train_and_save(run, out, rank, world) for run in runs}
    dist.barrier()
    if rank == 0 and argv[2:] == ["1"]:
        for run in runs:
            if run.zero_to_fp32_reads:
                _save_references(out, run.name, saved[run.name])
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class ZeroLaunch:
    """A started :func:`start_zero_runs`: wait for it with :meth:`wait`."""

    out: Path
    runs: tuple[ZeroRun, ...]
    process: subprocess.Popen[str]

    def wait(self, timeout: float = 600) -> dict[str, Path]:
        """Wait for the ranks to finish.

        Args:
            timeout: seconds to wait before killing them.

        Returns:
            Each run's name -> its save folder (``latest``, the tag folders, DeepSpeed's
            scripts).

        Raises:
            RuntimeError: the launch failed or left a run unsaved; the message carries the
                end of its output.
        """
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
        missing = [r.name for r in self.runs if not (self.out / r.name / "latest").is_file()]
        if self.process.returncode != 0 or missing:
            raise RuntimeError(
                f"DeepSpeed training exited {self.process.returncode} (runs not saved: "
                f"{missing}):\n{output[-6000:]}"
            )
        return {r.name: self.out / r.name for r in self.runs}


def start_zero_runs(
    out: str | os.PathLike[str],
    runs: Sequence[ZeroRun],
    *,
    world_size: int = 2,
    references: bool = False,
    env: Mapping[str, str] | None = None,
) -> ZeroLaunch:
    """Start training and saving ``runs`` with DeepSpeed on ``world_size`` CPU ranks (gloo)
    under torchrun, one run after the other in the same ranks.

    Args:
        out: the folder that receives one save folder per run.
        runs: the runs.
        world_size: the number of ranks (the data-parallel world size).
        references: also save ``zero_to_fp32``'s state dict of every saved tag
            (:func:`reference_path`) of the runs it reads.
        env: the ranks' environment (default: this process's).

    Returns:
        The running launch.

    Raises:
        UsageError: a bad run, or two with one name.
    """
    for run in runs:
        run.validate()
    if len({r.name for r in runs}) != len(runs):
        raise UsageError("two runs have the same name", argument="runs")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("DS_ACCELERATOR", "cpu")
    child_env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        "-m",
        "ckpt_tools.harness.zero",
        str(folder),
        json.dumps([asdict(r) for r in runs]),
        "1" if references else "0",
    ]
    process = subprocess.Popen(
        command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return ZeroLaunch(folder, tuple(runs), process)


def make_zero_checkpoints(
    out: str | os.PathLike[str],
    runs: Sequence[ZeroRun],
    *,
    world_size: int = 2,
    references: bool = False,
    timeout: float = 600,
) -> dict[str, Path]:
    """Train and save ``runs`` with DeepSpeed on ``world_size`` CPU ranks, and wait.

    Args:
        out, runs, world_size, references: as :func:`start_zero_runs` takes them.
        timeout: seconds the launch may take.

    Returns:
        Each run's name -> its save folder.

    Raises:
        UsageError: a bad run.
        RuntimeError: the launch failed; the message carries its output.

    Example:
        >>> make_zero_checkpoints("o", [ZeroRun("s2", stage=2)])  # doctest: +SKIP
        {'s2': PosixPath('o/s2')}
        >>> make_zero_checkpoints("o", [ZeroRun("s4", stage=4)])
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: stage=4: ZeRO has stages 0 to 3
    """
    launch = start_zero_runs(out, runs, world_size=world_size, references=references)
    return launch.wait(timeout)


def zero_missing() -> str | None:
    """Why the ``zero`` strategy cannot run here, or None when DeepSpeed is installed.

    Looked up without importing DeepSpeed (its import is slow and picks an accelerator).

    Returns:
        ``"the zero strategy needs deepspeed: pip install 'ckpt_tools[deepspeed]'"``, or None.

    Example:
        >>> zero_missing() in (None, str(MissingExtraError("the zero strategy", "deepspeed",
        ...                                                "deepspeed")))
        True
    """
    if importlib.util.find_spec("deepspeed") is not None:
        return None
    return str(MissingExtraError("the zero strategy", "deepspeed", "deepspeed"))


def train_zero(config: TrainConfig) -> TrainResult:
    """Train with DeepSpeed ZeRO at ``config.zero_stage``, spawning the ranks or, under
    torchrun, acting as one of them (see the module docstring).

    Args:
        config: the run; ``strategy`` is taken to be ``zero``.

    Returns:
        Spawned: rank 0's result. Under torchrun: this rank's result. With ``out_dir``,
        ``checkpoints`` names ``wrapped``, ``bare``, ``deepspeed`` (the folder) and
        ``zero_to_fp32``.

    Raises:
        MissingExtraError: DeepSpeed is not installed (a UsageError).
        UsageError: as :func:`ckpt_tools.harness.ddp.train_ddp`.
        RuntimeError: a spawned worker failed; the message carries its traceback.

    Example:
        >>> config = TrainConfig(strategy="zero", zero_stage=2, steps=2, out_dir="o")
        >>> sorted(train_zero(config).checkpoints)  # doctest: +SKIP
        ['bare', 'deepspeed', 'wrapped', 'zero_to_fp32']
    """
    if zero_missing() is not None:
        raise MissingExtraError("the zero strategy", "deepspeed", "deepspeed")
    from ckpt_tools.harness.ddp import launch

    return launch(config, train_rank)


def _engine(model: nn.Module, config: TrainConfig, world: int, device: torch.device) -> Any:
    """A DeepSpeed engine over ``model`` and the harness's SGD, ZeRO at ``config.zero_stage``."""
    import deepspeed.ops

    # Off before DeepSpeed wraps the process group: it would be compiled on first use.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # The harness's own SGD (a client optimizer), recorded per step by _record_step, not
    # by its step hook: under ZeRO it steps flat partitions, not the model's parameters.
    optimizer = loop.make_optimizer(model.parameters(), replace(config, record_steps=False))
    ds_config = {
        "train_micro_batch_size_per_gpu": -(-config.batch_size // world),
        "gradient_accumulation_steps": 1,
        # Small buckets: stages 1 and 2 allocate theirs whole (5e8 elements by default),
        # and the harness's models are tiny. Bucketing never changes an element's sum.
        "zero_optimization": {
            "stage": config.zero_stage,
            "reduce_bucket_size": 1 << 20,
            "allgather_bucket_size": 1 << 20,
        },
        # DeepSpeed vouches for its own optimizers only; torch's SGD steps ZeRO's flat
        # fp32 partitions elementwise, which is all ZeRO asks of an optimizer.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


@torch.no_grad()
def _record_step(model: nn.Module, config: TrainConfig, step: int, rank: int) -> None:
    """Rank 0 saves the model's parameters after ``step`` as :class:`loop.StepRecorder`
    does; ZeRO-3's partitioned parameters are gathered first (every rank takes part)."""
    import deepspeed

    params = list(model.parameters())
    gather: Any = contextlib.nullcontext()
    if config.zero_stage == 3:
        gather = deepspeed.zero.GatheredParameters(params)
    with gather:
        if rank == 0:
            folder = Path(str(config.out_dir)) / STEPS_DIR
            folder.mkdir(parents=True, exist_ok=True)
            saved = [p.detach().to("cpu", copy=True) for p in params]
            torch.save(saved, folder / f"{step:05d}.pt")


def _zero_steps(engine: Any, config: TrainConfig, rank: int, world: int) -> list[float]:
    """One rank's steps on its slice of each global batch; the global-batch loss of each."""
    import torch.distributed as dist

    losses: list[float] = []
    with loop.deterministic():
        for step, (images, labels) in enumerate(loop.global_batches(config), start=1):
            x = shard(images, rank, world).to(engine.device)
            y = shard(labels, rank, world).to(engine.device)
            # Scaled as for DDP: ZeRO averages the ranks' gradients, giving the global one.
            loss = loop.local_loss(engine(x), y, len(labels), world)
            engine.backward(loss)
            engine.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            losses.append(float(logged) / world)
            if config.record_steps and config.out_dir is not None:
                _record_step(engine.module, config, step, rank)
    return losses


def _save_zero(engine: Any, config: TrainConfig, rank: int) -> dict[str, str]:
    """``save_checkpoint`` (every rank), then rank 0's ``bare.pt``, ``wrapped.pt`` and
    ``zero_to_fp32.pt`` made from the folder. Returns the paths on rank 0, ``{}`` elsewhere."""
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from tqdm import tqdm

    from ckpt_tools.ops.consolidate.consolidation import consolidate

    out = Path(str(config.out_dir))
    folder = out / DEEPSPEED_DIR
    engine.save_checkpoint(str(folder))
    dist.barrier()  # every rank's files are complete before rank 0 reads them
    if rank != 0:
        return {}
    paths = {name: out / f"{name}.pt" for name in ("wrapped", "bare")}
    for path in paths.values():
        path.unlink(missing_ok=True)  # a re-run into the same folder
    consolidate(folder, paths["bare"])
    bare = torch.load(paths["bare"], map_location="cpu", weights_only=True)
    torch.save({f"module.{k}": v for k, v in bare.items()}, paths["wrapped"])
    # Its progress bars would take a multiprocessing lock that os._exit leaves behind
    # (the resource tracker then warns about a leaked semaphore): a thread lock does.
    tqdm.set_lock(threading.RLock())
    # Its report of what it read and its progress bars are not the harness's to print.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        reference = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    torch.save(reference, out / ZERO_TO_FP32)
    return {
        **{name: str(path) for name, path in paths.items()},
        DEEPSPEED_DIR: str(folder),
        "zero_to_fp32": str(out / ZERO_TO_FP32),
    }


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's prints and log lines to stderr, its expected warnings left out.

    stdout is the command's (``ckpt harness train --json`` under torchrun prints there);
    DeepSpeed's logger takes the stream of its first import, made inside. The warnings:
    the SGD that ZeRO has not tested (asked for on purpose), and torch's deprecation of
    the collectives DeepSpeed calls.
    """
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        deprecated = "`torch.distributed.[a-z_]+` is deprecated"
        warnings.filterwarnings("ignore", deprecated, FutureWarning)
        from deepspeed.utils import logger  # made now, it writes to stderr

        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def train_rank(
    rank: int,
    world: int,
    device: torch.device,
    config: TrainConfig,
    sync_bn: bool,
    backend: str,
    launcher: str,
) -> TrainResult:
    """One rank's DeepSpeed training and its part of the saves (see the module docstring).

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
    # DeepSpeed reads the rank layout from the environment; spawned ranks have none.
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(device.index if device.type == "cuda" else rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    # Before DeepSpeed's first import in this process (in _quiet): it picks its accelerator then.
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device.type == "cpu" else "cuda")
    model = loop.init_model(config, sync_bn=sync_bn).to(device)
    with _quiet():
        engine = _engine(model, config, world, device)
        started = time.perf_counter()
        losses = _zero_steps(engine, config, rank, world)
        seconds = time.perf_counter() - started
        checkpoints = _save_zero(engine, config, rank) if config.out_dir is not None else {}
        engine.destroy()
    what = f"{world} CPU processes over gloo, ZeRO-{config.zero_stage}"
    result = loop.finish_run(
        config,
        [device] * world,
        losses,
        model,
        model,
        engine.optimizer,
        loop.cpu_fallback([device], what),
        save=False,
    )
    return replace(
        result,
        devices=(str(device),),
        backend=backend,
        launcher=launcher,
        sync_bn=sync_bn,
        out_dir=str(config.out_dir) if checkpoints else None,
        checkpoints=checkpoints,
        seconds=seconds,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
