"""Loading checkpoints on any device, and into models whatever their wrappers.

:func:`load_state_dict` reads the saved device tags with the torch-free layer first, works
out where each storage should go (``map_location="auto"``: where it was saved when that
device exists here, else an existing GPU, else the CPU), refuses unsafe pickles unless
trusted, then loads with ``torch.load(weights_only=True, mmap=True)`` (zip files),
``safetensors`` or the legacy reader, and selects the model's state dict.

:func:`load_into` also reconciles wrapper prefixes (``module.``, ``_orig_mod.``,
``model.`` ...) between checkpoint and model, and reports what it did.
"""

from __future__ import annotations

import logging
import os
import pickle
import shlex
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ckpt_tools.errors import (
    StateDictMismatchError,
    UnsafeContentError,
    UnsupportedFormatError,
    UsageError,
)
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.grouping import group_names
from ckpt_tools.keys import rename_keys
from ckpt_tools.layouts import Selection, is_state_dict, select_state_dict
from ckpt_tools.suggest import (
    KeyFix,
    best_fix,
    fix_command,
    fix_python,
    rank_fixes,
    wrapper_stack,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "LoadInfo",
    "LoadReport",
    "MapLocation",
    "ShapeMismatch",
    "StorageMove",
    "auto_location",
    "load_into",
    "load_state_dict",
    "resolve_map_location",
]

logger = logging.getLogger("ckpt_tools")

#: Every form ``torch.load`` takes, plus ``"auto"``.
MapLocation = str | torch.device | Mapping[str, str] | Callable[[Any, str], Any] | None


@dataclass(frozen=True)
class StorageMove:
    """Where the storages saved under one device tag were loaded.

    Attributes:
        saved: the saved tag (``cuda:1``).
        target: the device they were loaded on (``cpu``).
        storages: how many storages.
        nbytes: their total size.
    """

    saved: str
    target: str
    storages: int
    nbytes: int

    @property
    def moved(self) -> bool:
        return self.saved != self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "saved": self.saved,
            "target": self.target,
            "storages": self.storages,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class LoadInfo:
    """How :func:`load_state_dict` loaded a checkpoint.

    Attributes:
        path: the file or folder.
        format: see :data:`ckpt_tools.formats.FORMATS`.
        selected: keys leading to the state dict (``()`` for the root).
        selection_reason: why it was chosen.
        map_location: the ``map_location`` as given, in words (``auto``, ``cpu``, ...).
        placements: one entry per saved device tag: where its storages went.
        mmap: the file was memory-mapped (zip files loaded to the CPU, no copy).
        trusted: loaded with ``trust=True`` (full unpickling).
        tensors: tensors in the returned state dict.
    """

    path: str
    format: str
    selected: tuple[str, ...]
    selection_reason: str
    map_location: str
    placements: tuple[StorageMove, ...]
    mmap: bool
    trusted: bool
    tensors: int

    @property
    def moved(self) -> tuple[StorageMove, ...]:
        """The placements whose device differs from the saved one."""
        return tuple(p for p in self.placements if p.moved)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "selected": list(self.selected),
            "selection_reason": self.selection_reason,
            "map_location": self.map_location,
            "placements": [p.to_json() for p in self.placements],
            "mmap": self.mmap,
            "trusted": self.trusted,
            "tensors": self.tensors,
        }


# ---------------------------------------------------------------------------------------
# Where storages go


def _device_available(device: torch.device) -> bool:
    if device.type in ("cpu", "meta"):
        return True
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if module is None or is_available is None or not is_available():
        return False
    count = getattr(module, "device_count", None)
    return device.index is None or count is None or device.index < count()


def auto_location(tag: str) -> str:
    """Where ``"auto"`` puts a storage saved under ``tag``.

    The saved device when it exists here; ``cuda:N`` past the visible GPUs goes to
    ``cuda:{N % count}``; a backend that is absent here (CUDA on a CPU-only machine, MPS
    elsewhere) goes to the CPU.

    Args:
        tag: a saved location tag (``cpu``, ``cuda``, ``cuda:1``, ``mps``).

    Returns:
        A device string torch accepts.

    Example:
        >>> auto_location("cpu")
        'cpu'
    """
    try:
        device = torch.device(tag)
    except RuntimeError:
        return "cpu"
    if device.type in ("cpu", "meta"):
        return device.type
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if module is None or is_available is None or not is_available():
        return "cpu"
    count_fn = getattr(module, "device_count", None)
    count = count_fn() if count_fn is not None else 1
    if count < 1:
        return "cpu"
    if device.index is None:
        return f"{device.type}:0" if count_fn is not None else device.type
    return f"{device.type}:{device.index % count}"


def _describe(map_location: MapLocation) -> str:
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        return f"<callable {getattr(map_location, '__qualname__', type(map_location).__name__)}>"
    if isinstance(map_location, Mapping):
        return repr(dict(map_location))
    return str(map_location)


def resolve_map_location(map_location: MapLocation, tags: Sequence[str]) -> dict[str, str] | None:
    """Where each saved tag goes, for every ``map_location`` form except callables.

    Args:
        map_location: ``"auto"``, ``None`` (where saved), a device string or
            ``torch.device``, a dict tag -> tag (unlisted tags stay), or a callable.
        tags: the saved tags of the checkpoint's storages.

    Returns:
        tag -> device string; None for a callable (known only once called).

    Raises:
        UsageError: a target device is malformed or does not exist here.

    Example:
        >>> resolve_map_location("auto", ["cpu"])
        {'cpu': 'cpu'}
    """
    if callable(map_location) and not isinstance(map_location, (str, torch.device, Mapping)):
        return None
    resolved: dict[str, str] = {}
    for tag in dict.fromkeys(tags):
        if isinstance(map_location, str) and map_location == "auto":
            resolved[tag] = auto_location(tag)
            continue
        if map_location is None:
            target: Any = tag
        elif isinstance(map_location, Mapping):
            target = map_location.get(tag, tag)
        elif isinstance(map_location, (str, torch.device)):
            target = map_location
        else:
            raise UsageError(
                f"map_location={map_location!r} is not a device, a dict of tags, a callable "
                "or 'auto'"
            )
        try:
            device = torch.device(target)
        except (RuntimeError, TypeError) as e:
            raise UsageError(
                f"map_location sends storages saved on {tag!r} to {target!r}, which is not a "
                "device (expected 'cpu', 'cuda:0', ...); or pass map_location='auto'"
            ) from e
        if not _device_available(device):
            raise UsageError(
                f"map_location sends storages saved on {tag!r} to {str(device)!r}, which does "
                f"not exist here (visible: {_visible()}); pass map_location='auto' to put each "
                "storage on an existing device, or map_location='cpu'"
            )
        resolved[tag] = str(device)
    return resolved


def _visible() -> str:
    names = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return ", ".join(names)


def _placements(ckpt: Checkpoint, resolved: Mapping[str, str]) -> tuple[StorageMove, ...]:
    storages: dict[str, list[int]] = {}
    for storage in ckpt.storages.values():
        entry = storages.setdefault(storage.device, [0, 0])
        entry[0] += 1
        entry[1] += storage.nbytes
    return tuple(
        StorageMove(tag, resolved.get(tag, tag), count, nbytes)
        for tag, (count, nbytes) in storages.items()
    )


class _Recorder:
    """Wraps a callable ``map_location`` to record where each saved tag went."""

    def __init__(self, func: Callable[[Any, str], Any]) -> None:
        self.func = func
        self.seen: dict[tuple[str, str], list[int]] = {}

    def __call__(self, storage: Any, location: str) -> Any:
        result = self.func(storage, location)
        # None means "where it was saved" (torch's default_restore_location).
        target = str(result.device) if result is not None else location
        entry = self.seen.setdefault((location, target), [0, 0])
        entry[0] += 1
        entry[1] += storage.nbytes()
        return result

    def placements(self) -> tuple[StorageMove, ...]:
        return tuple(StorageMove(s, t, n, b) for (s, t), (n, b) in self.seen.items())


# ---------------------------------------------------------------------------------------
# load_state_dict


def _check_format(ckpt: Checkpoint) -> None:
    if ckpt.format == "torchscript":
        raise UnsupportedFormatError(
            f"{ckpt.path!r} is a TorchScript archive, not a state dict; load it with "
            f"torch.jit.load({ckpt.path!r}, map_location=...) and call .state_dict()"
        )
    if ckpt.format == "pickle":
        raise UnsupportedFormatError(
            f"{ckpt.path!r} is a plain pickle without torch tensors; nothing to load as a "
            "state dict (inspect it with `ckpt inspect`)"
        )


def _check_trust(ckpt: Checkpoint, weights_only: bool, trust: bool) -> None:
    if not weights_only and not trust:
        raise UsageError(
            "weights_only=False runs whatever code the checkpoint's pickle names; say so "
            "explicitly with trust=True (only for files you trust)"
        )
    if ckpt.unsafe_globals and not trust:
        names = ", ".join(ckpt.unsafe_globals)
        allow = " ".join(f"--allow-global {shlex.quote(g)}" for g in ckpt.unsafe_globals)
        out = os.path.splitext(ckpt.path.rstrip("/"))[0] + ".safetensors"
        raise UnsafeContentError(
            f"{ckpt.path!r} refers to Python globals outside the weights-only allowlist: "
            f"{names}. Loading it would import and call them. If you trust the file, pass "
            f"trust=True (load_state_dict({ckpt.path!r}, trust=True)); otherwise keep only "
            f"the tensors, without running anything: `ckpt convert {shlex.quote(ckpt.path)} "
            f"{shlex.quote(out)} --drop-extras {allow}`",
            ckpt.unsafe_globals,
        )


def _torch_load(ckpt: Checkpoint, path: str, map_location: Any, trust: bool, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as e:
        if trust:
            raise
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UnsafeContentError(
            f"torch's weights-only unpickler refused {path!r} ({first}); if you trust the "
            "file, pass trust=True",
            ckpt.unsafe_globals,
        ) from e


def _load_safetensors(path: str, map_location: Any, resolved: dict[str, str] | None) -> Any:
    from safetensors.torch import load_file

    if resolved is not None:
        return load_file(path, device=resolved.get("cpu", "cpu"))
    loaded = load_file(path, device="cpu")
    out = {}
    for name, tensor in loaded.items():
        moved = map_location(tensor.untyped_storage(), "cpu")
        if moved is not None and moved.device != tensor.device:
            tensor = torch.empty(0, dtype=tensor.dtype, device=moved.device).set_(
                moved, tensor.storage_offset(), tensor.shape, tensor.stride()
            )
        out[name] = tensor
    return out


def _load_root(
    ckpt: Checkpoint, map_location: MapLocation, trust: bool
) -> tuple[Any, tuple[StorageMove, ...], bool]:
    """The whole loaded object tree, the placements, and whether it was memory-mapped."""
    tags = [s.device for s in ckpt.storages.values()]
    resolved = resolve_map_location(map_location, tags)
    recorder = None
    if resolved is None:
        recorder = _Recorder(map_location)  # type: ignore[arg-type]
        torch_location: Any = recorder
    else:
        torch_location = resolved
    if ckpt.format == "safetensors":
        root = _load_safetensors(ckpt.path, map_location, resolved)
        mmap = False
    elif ckpt.format in ("torch-zip", "torch-legacy", "torch-tar"):
        mmap = ckpt.format == "torch-zip"
        root = _torch_load(ckpt, ckpt.path, torch_location, trust, mmap)
    elif ckpt.format == "hf-sharded":
        return _load_shards(ckpt, map_location, trust)
    else:
        _check_format(ckpt)
        raise UnsupportedFormatError(f"{ckpt.path!r}: cannot load format {ckpt.format!r}")
    placements = recorder.placements() if recorder else _placements(ckpt, resolved or {})
    return root, placements, mmap


def _load_shards(
    ckpt: Checkpoint, map_location: MapLocation, trust: bool
) -> tuple[Any, tuple[StorageMove, ...], bool]:
    loaded: list[Any] = []
    totals: dict[tuple[str, str], list[int]] = {}
    mmap = False
    for sub in ckpt.shards.values():
        shard_root, placements, sub_mmap = _load_root(sub, map_location, trust)
        loaded.append(shard_root)
        mmap = mmap or sub_mmap
        for p in placements:
            entry = totals.setdefault((p.saved, p.target), [0, 0])
            entry[0] += p.storages
            entry[1] += p.nbytes
    root: dict[str, Any] = {}
    for name in ckpt.root:
        for shard_root in loaded:
            if isinstance(shard_root, Mapping) and name in shard_root:
                root[name] = shard_root[name]
                break
    merged = tuple(StorageMove(s, t, n, b) for (s, t), (n, b) in totals.items())
    return root, merged, mmap


def _walk(root: Any, path: tuple[str, ...], where: str) -> Any:
    node = root
    for part in path:
        if isinstance(node, Mapping):
            node = node[part] if part in node else node[int(part)]
        elif isinstance(node, (list, tuple)):
            node = node[int(part)]
        elif hasattr(node, "__dict__") and part in vars(node):
            node = vars(node)[part]
        else:
            raise UnsupportedFormatError(
                f"{where}: cannot follow {'.'.join(path)!r} in the loaded object at {part!r}"
            )
    return node


def _selection_checked(root: Any, select: str | Sequence[str] | None, where: str) -> Selection:
    selection = select_state_dict(root, select)
    if select is None and not is_state_dict(selection.state_dict):
        top = list(root)[:12] if isinstance(root, Mapping) else []
        raise UsageError(
            f"{where}: no entry looks like a state dict (a mapping of names to tensors); "
            f"top-level entries: {', '.join(map(str, top)) or 'none'}; pick one with "
            "select='a.b' (`--select a.b`)"
        )
    return selection


@overload
def load_state_dict(
    path: str | os.PathLike[str],
    map_location: MapLocation = ...,
    select: str | Sequence[str] | None = ...,
    weights_only: bool = ...,
    trust: bool = ...,
    *,
    return_info: Literal[False] = ...,
) -> dict[str, torch.Tensor]: ...


@overload
def load_state_dict(
    path: str | os.PathLike[str],
    map_location: MapLocation = ...,
    select: str | Sequence[str] | None = ...,
    weights_only: bool = ...,
    trust: bool = ...,
    *,
    return_info: Literal[True],
) -> tuple[dict[str, torch.Tensor], LoadInfo]: ...


def load_state_dict(
    path: str | os.PathLike[str],
    map_location: MapLocation = "auto",
    select: str | Sequence[str] | None = None,
    weights_only: bool = True,
    trust: bool = False,
    *,
    return_info: bool = False,
) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], LoadInfo]:
    """Load a checkpoint's state dict on any machine, safely.

    The saved device tags are read first without torch; ``map_location`` then decides
    where each storage goes, and targets that do not exist here are refused before any
    byte is loaded. Zip checkpoints are memory-mapped (``mmap=True``), safetensors are read
    with ``safetensors.torch.load_file``, legacy files with ``torch.load``. Devices that
    changed are logged on the ``ckpt_tools`` logger (INFO) and returned in :class:`LoadInfo`.

    Args:
        path: a checkpoint file (torch zip, legacy, safetensors) or a sharded folder.
        map_location: ``"auto"`` (default): each storage on its saved device when that
            exists, ``cuda:N`` beyond the visible GPUs on ``cuda:{N % count}``, GPU
            storages on the CPU when there is no GPU. Or anything ``torch.load`` takes: a
            device string, a ``torch.device``, a dict of tags (``{"cuda:1": "cuda:0"}``),
            a callable ``(storage, tag) -> storage | None``; ``None`` keeps saved devices.
        select: dotted path to the state dict (``"model.ema"``); default: chosen as
            :func:`ckpt_tools.select_state_dict` does.
        weights_only: kept for ``torch.load`` familiarity; ``False`` is accepted only
            together with ``trust=True``.
        trust: unpickle everything (``torch.load(weights_only=False)``): runs code named
            in the file. Needed when the checkpoint holds objects outside the allowlist
            (``argparse.Namespace`` hyperparameters, custom classes).
        return_info: also return a :class:`LoadInfo`.

    Returns:
        The state dict (as loaded, ``_metadata`` kept), or ``(state_dict, info)``.

    Raises:
        UnsafeContentError: globals outside the allowlist and no ``trust=True``.
        UsageError: ``map_location`` names a device that does not exist here, or
            ``weights_only=False`` without ``trust=True``, or nothing looks like a state dict.
        SelectError: ``select`` names a missing entry.
        UnsupportedFormatError: a TorchScript archive or a plain pickle.
        CheckpointError: the file is missing, truncated or malformed.

    Example:
        >>> sd, info = load_state_dict("ddp_gpu1.pt", return_info=True)  # doctest: +SKIP
        >>> [(p.saved, p.target) for p in info.moved]  # doctest: +SKIP
        [('cuda:1', 'cpu')]
    """
    ckpt = open_checkpoint(path)
    _check_format(ckpt)
    _check_trust(ckpt, weights_only, trust)
    where = ckpt.path
    selection = _selection_checked(ckpt.root, select, where)
    root, placements, mmap = _load_root(ckpt, map_location, trust)
    state_dict = _walk(root, selection.path, where) if selection.path else root
    if not isinstance(state_dict, Mapping):
        raise UnsupportedFormatError(
            f"{where}: {'.'.join(selection.path)!r} loaded as a {type(state_dict).__name__}, "
            "not a mapping; pick another entry with select="
        )
    if not isinstance(state_dict, dict):
        state_dict = dict(state_dict)
    for move in placements:
        if move.moved:
            logger.info(
                "%s: %d storage(s), %d bytes saved on %s loaded on %s",
                where,
                move.storages,
                move.nbytes,
                move.saved,
                move.target,
            )
    logger.debug("%s: state dict %r (%s)", where, ".".join(selection.path), selection.reason)
    if not return_info:
        return state_dict
    info = LoadInfo(
        path=where,
        format=ckpt.format,
        selected=selection.path,
        selection_reason=selection.reason,
        map_location=_describe(map_location),
        placements=placements,
        mmap=mmap,
        trusted=trust,
        tensors=sum(isinstance(v, torch.Tensor) for v in state_dict.values()),
    )
    return state_dict, info


# ---------------------------------------------------------------------------------------
# load_into


@dataclass(frozen=True)
class ShapeMismatch:
    """A key whose tensor shape differs between checkpoint and model."""

    key: str
    checkpoint: tuple[int, ...]
    model: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "checkpoint": list(self.checkpoint), "model": list(self.model)}


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_into` did.

    Attributes:
        source: the checkpoint path, or ``<state dict>``.
        model: the model's class name.
        model_layout: wrapper prefixes of the model's keys, outermost first.
        checkpoint_layout: wrapper prefixes of the checkpoint's keys, outermost first.
        rewrites: the key rewrites applied to the checkpoint (``stripping 'module.'``).
        loaded: keys copied into the model.
        missing: model keys the checkpoint lacks (after the rewrites).
        unexpected: checkpoint keys the model lacks (after the rewrites).
        shape_mismatches: keys present in both with different shapes (skipped).
        dtype_casts: ``(key, checkpoint dtype, model dtype)`` copied with a cast.
        info: how the file was loaded; None for an in-memory state dict.
    """

    source: str
    model: str
    model_layout: tuple[str, ...]
    checkpoint_layout: tuple[str, ...]
    rewrites: tuple[str, ...]
    loaded: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shape_mismatches: tuple[ShapeMismatch, ...] = ()
    dtype_casts: tuple[tuple[str, str, str], ...] = ()
    info: LoadInfo | None = None

    @property
    def ok(self) -> bool:
        """Every key matched in name and shape."""
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def __str__(self) -> str:
        how = f" ({', '.join(self.rewrites)})" if self.rewrites else ""
        lines = [f"loaded {self.loaded} keys from {self.source} into {self.model}{how}"]
        if self.missing:
            lines.append(f"missing ({len(self.missing)}): {fold_keys(self.missing)}")
        if self.unexpected:
            lines.append(f"unexpected ({len(self.unexpected)}): {fold_keys(self.unexpected)}")
        for m in self.shape_mismatches:
            lines.append(
                f"shape mismatch, skipped: {m.key} checkpoint {list(m.checkpoint)} vs model "
                f"{list(m.model)}"
            )
        if self.dtype_casts:
            lines.append(f"cast to the model's dtype: {len(self.dtype_casts)} keys")
        if self.info is not None and self.info.moved:
            moved = ", ".join(f"{m.saved} -> {m.target}" for m in self.info.moved)
            lines.append(f"devices: {moved}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "model": self.model,
            "model_layout": list(self.model_layout),
            "checkpoint_layout": list(self.checkpoint_layout),
            "rewrites": list(self.rewrites),
            "loaded": self.loaded,
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "shape_mismatches": [m.to_json() for m in self.shape_mismatches],
            "dtype_casts": [list(c) for c in self.dtype_casts],
            "info": self.info.to_json() if self.info else None,
        }


def fold_keys(keys: Sequence[str], limit: int = 6) -> str:
    """``layers.{0..11}.attn.weight ×12, head.bias`` (at most ``limit`` groups)."""
    groups = [g for g, _ in group_names(keys, str)]
    shown = [g.pattern + (f" ×{g.count}" if g.count > 1 else "") for g in groups[:limit]]
    more = f", ... ({len(groups) - limit} more groups)" if len(groups) > limit else ""
    return ", ".join(shown) + more


def _mismatch_message(
    report: LoadReport,
    select: str | Sequence[str] | None,
    source_keys: Sequence[str],
    model_keys: Sequence[str],
    applied: KeyFix | None,
) -> str:
    parts = [f"{report.source} does not match {report.model}"]
    if report.rewrites:
        parts.append(f"(after {', '.join(report.rewrites)})")
    lines = [" ".join(parts) + ":"]
    if report.missing:
        lines.append(
            f"  {len(report.missing)} missing (in the model, not in the checkpoint): "
            + fold_keys(report.missing)
        )
    if report.unexpected:
        lines.append(
            f"  {len(report.unexpected)} unexpected (in the checkpoint, not in the model): "
            + fold_keys(report.unexpected)
        )
    if report.shape_mismatches:
        shown = ", ".join(
            f"{m.key} checkpoint {list(m.checkpoint)} vs model {list(m.model)}"
            for m in report.shape_mismatches[:4]
        )
        more = " ..." if len(report.shape_mismatches) > 4 else ""
        lines.append(f"  {len(report.shape_mismatches)} shape mismatch(es): {shown}{more}")
    # A rewrite of the keys as stored (the command acts on the file) that does better than
    # the wrapper rewrite applied here.
    fixes = rank_fixes(source_keys, model_keys) if report.unexpected else ()
    done = (
        applied.matched if applied is not None else sum(k in set(model_keys) for k in source_keys)
    )
    if fixes and fixes[0].matched > done:
        fix = fixes[0]
        how = (
            fix_command(report.source, fix.steps, select)
            if report.info is not None
            else fix_python(fix.steps)
        )
        lines.append(
            f"  {fix.describe()} resolves {fix.resolved} of {fix.unmatched} unexpected keys: {how}"
        )
    lines.append(
        "Pass strict=False to load the keys that match and get the rest in the report, or "
        f"run `ckpt diff {report.source if report.source != '<state dict>' else 'CKPT'} "
        "--model MODULE:FACTORY` to see every difference."
    )
    return "\n".join(lines)


def _source_state_dict(
    source: str | os.PathLike[str] | Mapping[str, Any],
    map_location: MapLocation,
    select: str | Sequence[str] | None,
    trust: bool,
) -> tuple[Mapping[str, Any], str, LoadInfo | None]:
    if isinstance(source, Mapping):
        if select is not None or not is_state_dict(source):
            source = _selection_checked(source, select, "<state dict>").state_dict
        return source, "<state dict>", None
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(
            f"load_into source must be a checkpoint path or a state dict, got "
            f"{type(source).__name__}"
        )
    # The model's tensors are where the data ends up: stage on the CPU (memory-mapped) and
    # copy once, rather than holding a second copy on the GPU.
    location = "cpu" if isinstance(map_location, str) and map_location == "auto" else map_location
    sd, info = load_state_dict(
        source, map_location=location, select=select, trust=trust, return_info=True
    )
    if location is not map_location:
        info = replace(info, map_location="auto (staged on cpu)")
    return sd, info.path, info


def load_into(
    model: nn.Module,
    source: str | os.PathLike[str] | Mapping[str, Any],
    strict: bool = True,
    map_location: MapLocation = "auto",
    select: str | Sequence[str] | None = None,
    trust: bool = False,
) -> LoadReport:
    """Load a checkpoint into a model, reconciling wrapper prefixes on both sides.

    The wrapper stacks of the model's keys (plain, ``nn.DataParallel``/DDP ``module.``,
    ``torch.compile``'s ``_orig_mod.``, a Lightning-style ``model.`` attribute ...) and of
    the checkpoint's keys are compared (:func:`ckpt_tools.suggest.best_fix`), and the
    checkpoint's keys are rewritten with :mod:`ckpt_tools.keys` rules to match.

    Args:
        model: the target module (wrapped or not).
        source: a checkpoint path, or an in-memory state dict (or a dict holding one).
        strict: with True, any missing or unexpected key or shape mismatch raises and the
            model is left untouched; with False, matching keys load and the rest is reported
            (shape mismatches are skipped, where ``nn.Module.load_state_dict`` would raise).
        map_location: as for :func:`load_state_dict`; ``"auto"`` here stages storages on
            the CPU (memory-mapped) since they are copied into the model's tensors anyway.
        select: dotted path to the state dict inside the checkpoint.
        trust: see :func:`load_state_dict`.

    Returns:
        A :class:`LoadReport`.

    Raises:
        StateDictMismatchError: ``strict=True`` and the keys or shapes differ; the message
            lists them (repeated layers folded) and says how to proceed.
        UsageError, UnsafeContentError, CheckpointError: see :func:`load_state_dict`.

    Example:
        >>> report = load_into(torch.compile(Net()), "ddp.pt")  # doctest: +SKIP
        >>> report.rewrites  # doctest: +SKIP
        ("stripping 'module.'", "adding '_orig_mod.'")
    """
    sd, label, info = _source_state_dict(source, map_location, select, trust)
    target = model.state_dict()
    model_keys = list(target)
    source_keys = [str(k) for k in sd]
    fix = best_fix(source_keys, model_keys)
    if fix is not None:
        sd = rename_keys(sd, fix.rules)
        logger.info("%s: %s to match %s", label, fix.describe(), type(model).__name__)
    missing = tuple(k for k in model_keys if k not in sd)
    unexpected = tuple(k for k in sd if k not in target)
    shapes, casts = [], []
    for key, value in sd.items():
        have = target.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor)):
            continue
        if value.shape != have.shape:
            shapes.append(ShapeMismatch(key, tuple(value.shape), tuple(have.shape)))
        elif value.dtype != have.dtype:
            casts.append((key, _dtype_name(value.dtype), _dtype_name(have.dtype)))
    report = LoadReport(
        source=label,
        model=type(model).__name__,
        model_layout=tuple(m.prefix for m in wrapper_stack(model_keys)),
        checkpoint_layout=tuple(m.prefix for m in wrapper_stack(source_keys)),
        rewrites=tuple(step.describe() for step in fix.steps) if fix else (),
        loaded=0,
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=tuple(shapes),
        dtype_casts=tuple(casts),
        info=info,
    )
    if strict and not report.ok:
        raise StateDictMismatchError(
            _mismatch_message(report, select, source_keys, model_keys, fix)
        )
    skip = {m.key for m in shapes}
    filtered: Any = OrderedDict((k, v) for k, v in sd.items() if k not in skip)
    if getattr(sd, "_metadata", None) is not None:
        filtered._metadata = sd._metadata  # type: ignore[attr-defined]
    try:
        result = model.load_state_dict(filtered, strict=strict)
    except RuntimeError as e:
        raise StateDictMismatchError(
            f"{label}: {type(model).__name__}.load_state_dict refused the state dict: {e}"
        ) from e
    loaded = sum(1 for k in filtered if k in target)
    return replace(
        report,
        loaded=loaded,
        missing=tuple(k for k in result.missing_keys if k not in skip),
        unexpected=tuple(result.unexpected_keys),
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
