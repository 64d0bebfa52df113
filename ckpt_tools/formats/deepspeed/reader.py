"""A DeepSpeed ZeRO checkpoint opened torch-free: the model it holds, and where its bytes lie.

The opened checkpoint's root is the state dict DeepSpeed's ``zero_to_fp32`` rebuilds, in its
order: the buffers (rank 0's ``module`` entries named in ``buffer_names``; a 16-bit float
buffer stands for its fp32 upcast, an integer one keeps its dtype), the frozen parameters
(in their saved 16-bit dtype), the trained parameters (the optimizer's fp32 master copy, cut
from the ranks' flat partitions: :mod:`~ckpt_tools.formats.deepspeed.partitions`), and each
shared (tied) name, which holds the very descriptor of the parameter it shares.

At ZeRO-1, DeepSpeed records no frozen parameters (``zero_to_fp32`` leaves them out); they
are read from the module weights instead, where they lie whole in their 16-bit dtype.

Every tensor's bytes are a list of byte spans of the rank files (:class:`TensorSource`):
a consolidation copies them, never loading a partition.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef, contiguous_stride
from ckpt_tools.dtypes import FLOATING, itemsize
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.base import Checkpoint, consolidate_first
from ckpt_tools.formats.deepspeed.info import ZeroInfo, zero_info
from ckpt_tools.formats.deepspeed.layout import ZeroFiles, find_zero_files
from ckpt_tools.formats.deepspeed.partitions import (
    PartitionError,
    Slice,
    stage3_slices,
    stage12_slices,
)
from ckpt_tools.formats.deepspeed.states import (
    DEEPSPEED_GLOBALS,
    ModelStates,
    OptimStates,
    read_model_states,
    read_optim_states,
)
from ckpt_tools.formats.pickle.standins import storage_type_ref

__all__ = ["DeepSpeedCheckpoint", "TensorSource", "open_deepspeed"]


@dataclass(frozen=True)
class TensorSource:
    """Where one tensor's bytes are: ``spans`` of ``dtype`` elements, back to back.

    Attributes:
        kind: ``buffer``, ``frozen`` or ``trained``.
        dtype: the stored elements' dtype (a buffer's may differ from the tensor's: the
            tensor is its fp32 upcast).
        spans: byte ranges of the rank files, in order.
    """

    kind: str
    dtype: str
    spans: tuple[ByteSpan, ...]


@dataclass(frozen=True)
class DeepSpeedCheckpoint(Checkpoint):
    """A DeepSpeed checkpoint opened: the :class:`Checkpoint` fields, and

    Attributes:
        zero: what it is (:class:`ZeroInfo`).
        sources: name -> where its bytes lie, for every name but the shared aliases.
        aliases: alias -> the name it shares.
    """

    zero: ZeroInfo | None = None
    sources: Mapping[str, TensorSource] = field(default_factory=dict, repr=False)
    aliases: Mapping[str, str] = field(default_factory=dict)


def _spans_of(ckpt: Checkpoint, t: TensorRef, start: int, numel: int) -> ByteSpan:
    """``numel`` elements from element ``start`` of the 1-D contiguous tensor ``t``."""
    span = ckpt.span(t.storage)
    size = itemsize(t.dtype)
    return ByteSpan(span.path, span.offset + (t.offset + start) * size, numel * size)


def _whole(ckpt: Checkpoint, t: TensorRef, name: str) -> ByteSpan:
    if not t.is_contiguous():
        raise UnsupportedFormatError(
            f"{ckpt.path!r}: {name!r} is saved as a strided view, which DeepSpeed never saves",
            path=ckpt.path,
        )
    return _spans_of(ckpt, t, 0, t.numel)


def _descriptor(name: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
    """A contiguous tensor of its own storage: how the state dict's tensor is written."""
    storage = StorageRef(name, dtype, math.prod(shape), "cpu", storage_type_ref(dtype))
    return TensorRef(storage, 0, shape, contiguous_stride(shape), dtype)


class _Builder:
    """The state dict in ``zero_to_fp32``'s order, and each tensor's source."""

    def __init__(self) -> None:
        self.root: dict[str, TensorRef] = {}
        self.sources: dict[str, TensorSource] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: str, source: TensorSource) -> None:
        self.root[name] = _descriptor(name, dtype, shape)
        self.sources[name] = source


def _buffers(into: _Builder, base: ModelStates) -> None:
    for name, t in base.module.items():
        if name in base.buffer_names:
            # As DeepSpeed's v.float() where v.is_floating_point(), float8 included.
            dtype = "float32" if t.dtype in FLOATING else t.dtype
            source = TensorSource("buffer", t.dtype, (_whole(base.ckpt, t, name),))
            into.add(name, t.shape, dtype, source)


def _fragments(
    models: Sequence[ModelStates], name: str, numel: int
) -> list[tuple[ModelStates, TensorRef]]:
    """Each model file's saved fragment of frozen parameter ``name``, checked to hold its
    ``numel`` elements together, each contiguous."""
    found = [(m, (m.frozen_fragments or {}).get(name)) for m in models]
    pieces = [(m, p) for m, p in found if p is not None and p.is_contiguous()]
    if len(pieces) < len(found) or sum(p.numel for _, p in pieces) < numel:
        raise CorruptCheckpointError(
            f"{models[0].path!r}: the saved fragments of frozen parameter {name!r} do not hold "
            f"its {numel} elements",
            path=models[0].path,
        )
    return pieces


def _frozen(into: _Builder, models: Sequence[ModelStates], stage: int) -> tuple[str, ...]:
    """The frozen parameters DeepSpeed recorded (stage 2 and 3: rank 0's whole parameter,
    or every rank's fragment, cut to its size as ``zero_to_fp32`` cuts it); their names."""
    base = models[0]
    if base.frozen_shapes is None:
        return ()
    for name, shape in base.frozen_shapes.items():
        numel = math.prod(shape)
        pieces = _fragments(models if stage == 3 else models[:1], name, numel)
        spans, left = [], numel
        for m, p in pieces:
            take = min(left, p.numel)
            if take:
                spans.append(_spans_of(m.ckpt, p, 0, take))
            left -= take
        dtype = pieces[0][1].dtype
        into.add(name, shape, dtype, TensorSource("frozen", dtype, tuple(spans)))
    return tuple(base.frozen_shapes)


def _frozen_from_module(into: _Builder, base: ModelStates) -> tuple[str, ...]:
    """ZeRO-1: the module weights that are neither trained, buffers nor aliases: a shared
    name DeepSpeed records, or a second path to a module (``self.alias = self.l1``), whose
    weights lie in the storage of the name it repeats."""
    known = {n for group in base.param_shapes for n in group} | set(base.buffer_names)
    held = {base.module[n].storage.key for n in known if n in base.module}
    names = [
        n
        for n, t in base.module.items()
        if n not in known and n not in base.shared and t.storage.key not in held
    ]
    for name in names:
        t = base.module[name]
        into.add(
            name, t.shape, t.dtype, TensorSource("frozen", t.dtype, (_whole(base.ckpt, t, name),))
        )
    return tuple(names)


def _slices(
    models: Sequence[ModelStates], optims: Sequence[OptimStates], stage: int
) -> dict[str, list[Slice]]:
    sizes = [[t.numel for t in o.flat_groups] for o in optims]
    groups = [{n: math.prod(s) for n, s in g.items()} for g in models[0].param_shapes]
    try:
        if stage == 3:
            return stage3_slices({n: c for g in groups for n, c in g.items()}, sizes)
        return stage12_slices(groups, sizes, optims[0].alignment_paddings)
    except PartitionError as e:
        names = ", ".join(repr(os.path.basename(o.path)) for o in optims[:2])
        raise CorruptCheckpointError(
            f"{models[0].path!r}: its parameter shapes do not fit the partitions of {names}"
            f"{' ...' if len(optims) > 2 else ''}: {e}",
            path=models[0].path,
        ) from e


def _trained(
    into: _Builder, models: Sequence[ModelStates], optims: Sequence[OptimStates], stage: int
) -> None:
    slices = _slices(models, optims, stage)
    dtype = optims[0].flat_groups[0].dtype
    for group in models[0].param_shapes:
        for name, shape in group.items():
            spans = tuple(
                _spans_of(
                    optims[s.rank].ckpt, optims[s.rank].flat_groups[s.group], s.start, s.numel
                )
                for s in slices[name]
                if s.numel
            )
            into.add(name, shape, dtype, TensorSource("trained", dtype, spans))


def _check_ranks(
    files: ZeroFiles, models: Sequence[ModelStates], optims: Sequence[OptimStates]
) -> int:
    """The ZeRO stage, once the rank files agree with each other and with their count.

    As ``zero_to_fp32``: every optimizer states file is read, so their count must be the
    partition count; of the ZeRO-3 model states files only ranks below it are (the caller
    drops the others), so only a missing one is refused.
    """
    first = optims[0]
    world = first.partition_count
    if len(optims) != world:
        raise files.count_error(files.optim_files, world, "optimizer states", first.path)
    for o in optims[1:]:
        if (o.stage, o.partition_count, len(o.flat_groups)) != (
            first.stage,
            world,
            len(first.flat_groups),
        ) or o.flat_groups[0].dtype != first.flat_groups[0].dtype:
            raise CorruptCheckpointError(
                f"{o.path!r} disagrees with {os.path.basename(first.path)!r} on the stage, the "
                "partition count, the groups or their dtype",
                path=o.path,
            )
    # The bf16 optimizer records no stage; it partitions as ZeRO-1 does (frozen weights too).
    stage = first.stage if first.stage is not None else min(_config_stage(models[0]) or 1, 2)
    if stage == 3 and len(models) < world:
        raise files.count_error(files.model_files, world, "ZeRO-3 model states", first.path)
    if stage == 0:
        raise UnsupportedFormatError(
            f"{first.path!r} is a ZeRO-0 optimizer file, which holds no partition to read",
            path=first.path,
        )
    return stage


def open_deepspeed(path: str | os.PathLike[str], *, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Open a DeepSpeed ZeRO checkpoint without torch: its state dict and where its bytes lie.

    Args:
        path: the save folder (``latest`` names the tag) or a tag folder.
        tag: the tag to read in a save folder (default: ``latest``'s).

    Returns:
        A ``deepspeed`` :class:`DeepSpeedCheckpoint` whose root is the state dict
        ``zero_to_fp32`` rebuilds.

    Raises:
        UsageError: ``tag`` names no tag folder.
        CorruptCheckpointError: a missing or truncated rank file, a ``latest`` that names no
            folder, shapes that do not fit the partitions.
        UnsupportedFormatError: a layout this reader does not read (model parallelism).
        UnsafeContentError: a rank file refers to a global outside DeepSpeed's classes
            where only they may be.

    Example:
        >>> open_deepspeed("model.pt")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.CheckpointNotFoundError: no such folder: 'model.pt'
    """
    files = find_zero_files(path, tag)
    models = [read_model_states(files.path(n)) for n in files.model_files]
    optims = [read_optim_states(files.path(n)) for n in files.optim_files]
    into = _Builder()
    if optims:
        stage = _check_ranks(files, models, optims)
        if stage == 3:
            models = models[: len(optims)]  # a stale rank's model states, as zero_to_fp32 does
        frozen, from_module, aliases = _partitioned(into, models, optims, stage)
        root: dict[str, TensorRef] = dict(into.root)
        for alias, source in aliases.items():
            root[alias] = into.root[source]
    else:
        stage, frozen, from_module = _plain_stage(files, models[0]), (), False
        aliases = _plain(into, models[0])
        root = {n: into.root[aliases.get(n, n)] for n in models[0].module}
    where = os.fspath(path)
    return DeepSpeedCheckpoint(
        path=where,
        format="deepspeed",
        root=root,
        storages={t.storage.key: t.storage for t in into.root.values()},
        unsafe_globals=tuple(
            sorted({g for m in models for g in m.ckpt.unsafe_globals} - DEEPSPEED_GLOBALS)
        ),
        locate=_locator(where, into),
        zero=zero_info(files, models, optims, stage, frozen, from_module, aliases),
        sources=into.sources,
        aliases=aliases,
    )


def _partitioned(
    into: _Builder, models: Sequence[ModelStates], optims: Sequence[OptimStates], stage: int
) -> tuple[tuple[str, ...], bool, dict[str, str]]:
    """ZeRO 1-3: buffers, frozen and trained parameters, in ``zero_to_fp32``'s order.

    Returns the frozen names, whether they came from the module weights, and the aliases.
    """
    _buffers(into, models[0])
    frozen = _frozen(into, models, stage)
    from_module = not frozen and stage < 2
    if from_module:
        frozen = _frozen_from_module(into, models[0])
    _trained(into, models, optims, stage)
    shared = models[0].shared.items()
    return frozen, from_module, {a: s for a, s in shared if s in into.root and a not in into.root}


def _config_stage(base: ModelStates) -> int | None:
    """The ZeRO stage the run's saved ``ds_config`` asks for (0 without a ZeRO section), None
    where the config was saved as a path or not at all."""
    config = base.others.get("ds_config")
    if not isinstance(config, dict):
        return None
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return stage if type(stage) is int else None


def _plain_stage(files: ZeroFiles, base: ModelStates) -> int:
    """0, for a tag folder without optimizer partitions whose run asked for no ZeRO.

    Raises:
        CorruptCheckpointError: the run's config asks for ZeRO 1-3: its partitions are gone.
        UnsupportedFormatError: the config was not saved, so the stage is unknown.
    """
    stage = _config_stage(base)
    if stage == 0 and len(files.model_files) == 1:
        return 0
    if stage is None:
        raise UnsupportedFormatError(
            f"{files.folder!r} holds no optimizer states files and its ds_config is not saved, "
            "so its ZeRO stage is unknown",
            path=files.folder,
        )
    raise CorruptCheckpointError(
        f"{files.folder!r} holds no optimizer states files, though its run trained with ZeRO "
        f"stage {stage}: the ranks' partitions are missing",
        path=files.folder,
    )


def _plain(into: _Builder, base: ModelStates) -> dict[str, str]:
    """ZeRO-0: the module's tensors as saved (no partition to read; a 16-bit run's fp32
    master copy, in the optimizer's state, is not read); a name over the same view as an
    earlier one is its alias. Returns the aliases."""
    seen: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for name, t in base.module.items():
        view = (id(t.storage), t.offset, t.shape, t.stride)
        if view in seen:
            aliases[name] = seen[view]
            continue
        seen[view] = name
        kind = "buffer" if name in base.buffer_names else "trained"
        source = TensorSource(kind, t.dtype, (_whole(base.ckpt, t, name),))
        into.add(name, t.shape, t.dtype, source)
    return aliases


def _locator(where: str, into: _Builder) -> Any:
    def locate(storage: StorageRef) -> ByteSpan:
        source = into.sources[storage.key]
        if len(source.spans) == 1 and source.dtype == storage.dtype:
            return source.spans[0]
        how = (
            f"is saved as {source.dtype} and read as its {storage.dtype} upcast"
            if len(source.spans) == 1
            else "is cut from the ranks' partitions"
        )
        raise consolidate_first(
            where,
            f"is a DeepSpeed ZeRO checkpoint: tensor {storage.key!r} {how}, so it has no "
            "single byte range",
        )

    return locate
