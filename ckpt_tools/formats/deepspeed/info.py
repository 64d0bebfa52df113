"""What a DeepSpeed checkpoint is, beside its tensors: :class:`ZeroInfo`, which
``ckpt inspect`` reports (tag, stage, world sizes, dtypes, frozen and shared parameters, and
what each file of the tag folder holds).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools.formats.deepspeed.layout import ZeroFiles, tags_in
from ckpt_tools.formats.deepspeed.states import DEEPSPEED_GLOBALS, ModelStates, OptimStates

__all__ = ["RankFile", "ZeroInfo", "zero_info"]


@dataclass(frozen=True)
class RankFile:
    """One file of the tag folder and what it holds, in words."""

    name: str
    holds: str


@dataclass(frozen=True)
class ZeroInfo:
    """What a DeepSpeed checkpoint is, beside its tensors (``ckpt inspect`` reports it).

    Attributes:
        tag: the tag read.
        tags: every tag folder of the save folder (just ``tag`` for a tag folder).
        stage: the ZeRO stage.
        optimizer: ``ZeRO``, ``bf16 optimizer`` (DeepSpeed's BF16_Optimizer), or ``none``
            (ZeRO-0, whose module weights are the model).
        dp_world_size: data-parallel ranks (the partitions).
        mp_world_size: model-parallel ranks, as recorded.
        master_dtype: the dtype of the optimizer's master weights.
        weights_dtype: the dtype of the module's (training) weights.
        ds_version: the DeepSpeed version that saved it.
        frozen: the frozen parameters.
        frozen_from_module: the frozen parameters were read from the module weights
            (ZeRO-1 records none).
        shared: ``(alias, parameter)`` pairs of tied parameters.
        files: every file of the tag folder and what it holds.
        data_globals: DeepSpeed's classes its pickles name, read as data.
    """

    tag: str
    tags: tuple[str, ...]
    stage: int
    optimizer: str
    dp_world_size: int
    mp_world_size: int
    master_dtype: str
    weights_dtype: str
    ds_version: str | None
    frozen: tuple[str, ...]
    frozen_from_module: bool
    shared: tuple[tuple[str, str], ...]
    files: tuple[RankFile, ...]
    data_globals: tuple[str, ...]

    def lines(self) -> list[str]:
        """The summary lines ``ckpt inspect`` prints for it."""
        where = " (from the module weights: ZeRO-1 records none)" if self.frozen_from_module else ""
        lines = [
            f"deepspeed:   tag {self.tag}"
            + (f" (tags: {', '.join(self.tags)})" if len(self.tags) > 1 else "")
            + f", ZeRO stage {self.stage}"
            + {"ZeRO": "", "none": " (the module weights as saved)"}.get(
                self.optimizer, f" with the {self.optimizer}"
            )
            + f", DeepSpeed {self.ds_version or '?'}",
            f"ranks:       data-parallel {self.dp_world_size}, model-parallel {self.mp_world_size}",
            f"weights:     master {self.master_dtype}, module {self.weights_dtype}",
            f"frozen:      {', '.join(self.frozen) or 'none'}{where}",
            "shared:      "
            + (", ".join(f"{a} = {s}" for a, s in self.shared) if self.shared else "none"),
            "files:",
        ]
        lines += [f"  {f.name}: {f.holds}" for f in self.files]
        if self.data_globals:
            lines.append(f"read as data: {', '.join(self.data_globals)} (never imported)")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "tag": self.tag,
            "tags": list(self.tags),
            "stage": self.stage,
            "optimizer": self.optimizer,
            "dp_world_size": self.dp_world_size,
            "mp_world_size": self.mp_world_size,
            "master_dtype": self.master_dtype,
            "weights_dtype": self.weights_dtype,
            "ds_version": self.ds_version,
            "frozen": list(self.frozen),
            "frozen_from_module": self.frozen_from_module,
            "shared": {alias: source for alias, source in self.shared},
            "files": {f.name: f.holds for f in self.files},
            "data_globals": list(self.data_globals),
        }


def _holds_model(m: ModelStates, stage: int) -> str:
    run = [k for k in ("global_steps", "lr_scheduler", "ds_config") if m.others.get(k) is not None]
    known = {"optimizer", "buffer_names", "param_shapes", "dp_world_size", "mp_world_size"}
    known |= {"checkpoint_parallel_dimensions", "ds_version", "skipped_steps", "global_samples"}
    known |= {"lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names"}
    known |= {"global_steps", "ds_config", "universal_checkpoint_info"}
    client = [k for k in m.others if k not in known]
    weights = "placeholder weights (ZeRO-3)" if stage == 3 else "module weights"
    parts = [f"{weights} and buffers ({len(m.module)} tensors)"]
    if m.frozen_fragments:
        parts.append(f"{len(m.frozen_fragments)} frozen fragments")
    if m.param_shapes:
        parts.append("parameter shapes")
    if run:
        parts.append("run state (" + ", ".join(run) + ")")
    if client:
        parts.append("client state (" + ", ".join(map(str, client[:6])) + ")")
    return ", ".join(parts)


def _holds_optim(o: OptimStates) -> str:
    numel = sum(t.numel for t in o.flat_groups)
    groups = f"{len(o.flat_groups)} group{'s' if len(o.flat_groups) > 1 else ''}"
    what = f"{o.flat_groups[0].dtype} partition ({numel} elements in {groups})"
    return ", ".join([what, *o.holds])


def _optimizer(optims: Sequence[OptimStates]) -> str:
    if not optims:
        return "none"  # ZeRO-0: the module's weights are the model
    return "ZeRO" if optims[0].stage is not None else "bf16 optimizer"


def _count(base: ModelStates, key: str) -> int:
    value = base.others.get(key)
    return value if type(value) is int and value > 0 else 1


def zero_info(
    files: ZeroFiles,
    models: Sequence[ModelStates],
    optims: Sequence[OptimStates],
    stage: int,
    frozen: tuple[str, ...],
    from_module: bool,
    shared: Mapping[str, str],
) -> ZeroInfo:
    """What the read rank files say about the checkpoint.

    Args:
        files: the tag folder's files.
        models: its model states, by rank; optims: its optimizer states, by rank.
        stage: the ZeRO stage.
        frozen: the frozen parameters' names.
        from_module: they were read from the module weights (ZeRO-1).
        shared: alias -> the name it shares.

    Returns:
        The :class:`ZeroInfo`.
    """
    base = models[0]
    described = {os.path.basename(m.path): _holds_model(m, stage) for m in models}
    described |= {os.path.basename(o.path): _holds_optim(o) for o in optims}
    files_ = [
        RankFile(n, described.get(n, "not read")) for n in sorted({*described, *files.others})
    ]
    weights = [t.dtype for n, t in base.module.items() if n not in base.buffer_names]
    found = {g for f in (*models, *optims) for g in f.ckpt.unsafe_globals}
    version = base.others.get("ds_version")
    tags = [files.tag]
    if files.save_dir is not None:
        tags = tags_in(files.save_dir)
    return ZeroInfo(
        tag=files.tag,
        tags=tuple(tags),
        stage=stage,
        optimizer=_optimizer(optims),
        dp_world_size=optims[0].partition_count if optims else _count(base, "dp_world_size"),
        mp_world_size=_count(base, "mp_world_size"),
        master_dtype=optims[0].flat_groups[0].dtype if optims else "none",
        weights_dtype=max(set(weights), key=weights.count) if weights else "none",
        ds_version=version if isinstance(version, str) else None,
        frozen=frozen,
        frozen_from_module=from_module,
        shared=tuple(shared.items()),
        files=tuple(files_),
        data_globals=tuple(sorted(found & DEEPSPEED_GLOBALS)),
    )
