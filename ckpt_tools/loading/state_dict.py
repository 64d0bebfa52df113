"""Loading checkpoints on any device, and into models whatever their wrappers.

:func:`load_state_dict` reads the saved device tags with the torch-free layer first, works
out where each storage should go (``map_location="auto"``: where it was saved when that
device exists here, else an existing GPU, else the CPU), refuses unsafe pickles unless
trusted, then loads with ``torch.load(weights_only=True, mmap=True)`` (zip files),
``safetensors`` or the legacy reader, and selects the model's state dict.

:func:`ckpt_tools.loading.into_module.load_into` builds on it to load into wrapped or plain models.
"""

from __future__ import annotations

import logging
import os
import pickle
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ckpt_tools.errors import (
    Remedy,
    UnsafeContentError,
    UnsupportedFormatError,
    UsageError,
)
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.loading.devices import MapLocation, auto_location, resolve_map_location
from ckpt_tools.loading.results import LoadInfo, StorageMove
from ckpt_tools.structure.selection import Selection, is_state_dict, select_state_dict

if TYPE_CHECKING:
    pass

__all__ = [
    "LoadInfo",
    "MapLocation",
    "StorageMove",
    "auto_location",
    "load_state_dict",
    "resolve_map_location",
]

logger = logging.getLogger("ckpt_tools")


# ---------------------------------------------------------------------------------------
# Where storages go


def _describe(map_location: MapLocation) -> str:
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        return f"<callable {getattr(map_location, '__qualname__', type(map_location).__name__)}>"
    if isinstance(map_location, Mapping):
        return repr(dict(map_location))
    return str(map_location)


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
            f"torch.jit.load({ckpt.path!r}, map_location=...) and call .state_dict()",
            path=ckpt.path,
        )
    if ckpt.format == "pickle":
        raise UnsupportedFormatError(
            f"{ckpt.path!r} is a plain pickle without torch tensors; nothing to load as a "
            "state dict",
            path=ckpt.path,
            remedies=(Remedy(command=f"ckpt inspect {shlex.quote(ckpt.path)}", text="to see it"),),
        )


def _check_trust(ckpt: Checkpoint, weights_only: bool, trust: bool) -> None:
    if not weights_only and not trust:
        raise UsageError(
            "runs whatever code the checkpoint's pickle names",
            argument="weights_only",
            value="False",
            path=ckpt.path,
            remedies=(
                Remedy("trust", "True", text="to say so explicitly (only for files you trust)"),
            ),
        )
    if ckpt.unsafe_globals and not trust:
        names = ", ".join(ckpt.unsafe_globals)
        allow = " ".join(f"--allow-global {shlex.quote(g)}" for g in ckpt.unsafe_globals)
        out = os.path.splitext(ckpt.path.rstrip("/"))[0] + ".safetensors"
        raise UnsafeContentError(
            f"{ckpt.path!r} refers to Python globals outside the weights-only allowlist: "
            f"{names}; loading it would import and call them",
            ckpt.unsafe_globals,
            path=ckpt.path,
            remedies=(
                Remedy("trust", "True", text="if you trust the file"),
                Remedy(
                    command=f"ckpt convert {shlex.quote(ckpt.path)} {shlex.quote(out)} "
                    f"--drop-extras {allow}",
                    text="to keep only the tensors, without running anything",
                ),
            ),
        )


def _torch_load(ckpt: Checkpoint, path: str, map_location: Any, trust: bool, mmap: bool) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as e:
        if trust:
            raise
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UnsafeContentError(
            f"torch's weights-only unpickler refused {path!r} ({first})",
            ckpt.unsafe_globals,
            path=path,
            remedies=(Remedy("trust", "True", text="if you trust the file"),),
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
            f"top-level entries: {', '.join(map(str, top)) or 'none'}",
            remedies=(Remedy("select", "'a.b'", flag="--select a.b", text="to pick one"),),
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
            "not a mapping",
            path=where,
            remedies=(
                Remedy("select", "'a.b'", flag="--select a.b", text="to pick another entry"),
            ),
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
