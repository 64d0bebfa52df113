"""``load_state_dict(..., trust=True)``: the file handed to ``torch.load(weights_only=False)``.

Only reached when the caller said the file may run its code, and the file holds a pickle
(safetensors files are read by the own reader whatever ``trust`` says). Safetensors shards
of a folder that also holds pickled shards go through ``safetensors.torch.load_file``;
torch zip records are memory-mapped only with ``mmap=True``; every storage's move is recorded
so that :class:`~ckpt_tools.loading.results.LoadInfo` says where it went, as the torch-free
path does.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckpt_tools._types import MapLocation, Select
from ckpt_tools.errors import (
    CheckpointError,
    CorruptCheckpointError,
    Remedy,
    UnsupportedFormatError,
    UsageError,
)
from ckpt_tools.formats import Checkpoint
from ckpt_tools.loading.devices import checked_device, resolve_map_location
from ckpt_tools.loading.extras import require_safetensors
from ckpt_tools.loading.results import StorageMove
from ckpt_tools.loading.storages import EXACT_FORMATS, placed_storage
from ckpt_tools.structure.paths import mapping_at, parse_select, resolve_path, walk_path
from ckpt_tools.structure.selection import Selection, a_kind_of, select_state_dict

__all__ = ["load_trusted"]


def load_trusted(
    ckpt: Checkpoint,
    map_location: MapLocation,
    selection: Selection | None,
    select: Select,
    mmap: bool = False,
) -> tuple[Mapping[Any, Any], tuple[StorageMove, ...], bool, Selection]:
    """The selected state dict of the fully unpickled file, where its storages went, whether
    it was memory-mapped, and how it was chosen.

    Args:
        ckpt: the opened checkpoint.
        map_location: as :func:`ckpt_tools.load_state_dict` takes it.
        selection: the state dict chosen in the torch-free tree; None to choose it in the
            loaded one (an object of a class the reader did not import stood in the way).
        select: the caller's ``select``, for a choice made in the loaded tree.
        mmap: ``torch.load``'s ``mmap`` for torch zip files (others are read either way).

    Returns:
        ``(state_dict, placements, mapped, selection)``: ``mapped`` says whether the file
        was mapped.

    Raises:
        UnsupportedFormatError: the format cannot be loaded, or the loaded tree lacks the
            chosen path.
        UsageError: nothing in the loaded tree looks like a state dict.
        SelectError: ``select`` names a missing entry, or one that is no mapping.
    """
    root, placements, mapped = _load_root(ckpt, map_location, mmap)
    if selection is None:
        selection = _chosen_in_loaded(root, select, ckpt.path)
    return _state_dict_at(root, selection.path, ckpt.path), placements, mapped, selection


def _chosen_in_loaded(root: Any, select: Select, where: str) -> Selection:
    """The state dict chosen in the tree ``torch.load`` built, as the torch-free tree is
    chosen in: a module stands for its ``state_dict()``, a dict subclass is a mapping."""
    parts = parse_select(select)
    node = root if parts is None else resolve_path(root, parts).node
    if isinstance(node, torch.nn.Module):
        why = f"a {type(node).__name__} built by torch.load: its state_dict()"
        return Selection(parts or (), why, {})
    # A module under an entry ({"model": Net, "epoch": 3}) is its state dict, as the
    # torch-free choice recovers it; the path found leads to the module itself.
    selection = select_state_dict(_modules_as_state_dicts(root), select=select)
    if selection.stand_in or not selection.found:
        raise UsageError(
            f"{where}: torch.load(weights_only=False) built {a_kind_of(node)}, in which no "
            "entry looks like a state dict (a mapping of names to tensors)",
            remedies=(Remedy("select", "'a.b'", flag="--select a.b", text="to pick one"),),
        )
    return selection


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

    def __init__(self, func: Callable[[Any, str], Any], exact: bool) -> None:
        self.func = func
        self.exact = exact  # a legacy or tar file: torch needs the saved size exactly
        self.seen: dict[tuple[str, str], list[int]] = {}
        self.raised: BaseException | None = None

    def __call__(self, storage: Any, location: str) -> Any:
        try:
            result = self.func(storage, location)
        except Exception as e:
            self.raised = e  # the caller's own error: passed on as it is, not as the file's
            raise
        # None means "where it was saved" (torch's default_restore_location): a device that
        # must exist here.
        if result is None:
            target = checked_device(location, location, self.func)
        else:
            target = str(placed_storage(result, storage, location, self.exact).device)
        entry = self.seen.setdefault((location, target), [0, 0])
        entry[0] += 1
        entry[1] += storage.nbytes()
        return result

    def placements(self) -> tuple[StorageMove, ...]:
        return tuple(StorageMove(s, t, n, b) for (s, t), (n, b) in self.seen.items())


def _torch_load(path: str, map_location: Any, mmap: bool, unsafe: bool) -> Any:
    # Only ever reached with trust=True: the caller said the file may run its code.
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except CheckpointError:
        raise  # ours, from the map_location recorder: already said for the user
    except (ImportError, AttributeError) as e:
        # What unpickling raises when a global the pickle names is not importable here.
        raise UnsupportedFormatError(
            f"{path!r}: torch.load(weights_only=False) cannot build an object the file "
            f"names: {type(e).__name__}: {e}",
            path=path,
            remedies=(Remedy(text="make the code the file names importable here"),),
        ) from e
    except (pickle.UnpicklingError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path!r}: torch.load(weights_only=False) cannot unpickle it: {type(e).__name__}: {e}",
            path=path,
        ) from e
    except (RuntimeError, ValueError, TypeError) as e:
        if e is getattr(map_location, "raised", None):
            raise
        # torch's own rebuilds can fail on a file it wrote (a complex32 leaf that requires
        # grad): said as torch said it, in one line, not as a bug of ours. The own reader,
        # which never calls torch.load, reads such a file where it names no unsafe global.
        without = (Remedy("trust", "False", text="to read it without torch.load"),)
        raise UnsupportedFormatError(
            f"{path!r}: torch.load(weights_only=False) failed: {type(e).__name__}: {e}",
            path=path,
            remedies=() if unsafe else without,
        ) from e


def _load_safetensors(path: str, map_location: Any, resolved: dict[str, str] | None) -> Any:
    load_file = require_safetensors("load_state_dict(trust=True)").load_file
    if resolved is not None:
        return load_file(path, device=resolved.get("cpu", "cpu"))
    loaded = load_file(path, device="cpu")
    out = {}
    for name, tensor in loaded.items():
        moved = map_location(tensor.untyped_storage(), "cpu")
        if (
            moved is not None
            and placed_storage(moved, tensor.untyped_storage(), "cpu").device != tensor.device
        ):
            tensor = torch.empty(0, dtype=tensor.dtype, device=moved.device).set_(
                moved, tensor.storage_offset(), tensor.shape, tensor.stride()
            )
        out[name] = tensor
    return out


def _load_root(
    ckpt: Checkpoint, map_location: MapLocation, mmap: bool
) -> tuple[Any, tuple[StorageMove, ...], bool]:
    """The whole loaded object tree, the placements, and whether it was memory-mapped."""
    tags = [s.device for s in ckpt.storages.values()]
    resolved = resolve_map_location(map_location, tags)
    recorder = None
    if resolved is None:
        exact = ckpt.format in EXACT_FORMATS
        recorder = _Recorder(map_location, exact)  # type: ignore[arg-type]
        torch_location: Any = recorder
    else:
        torch_location = resolved
    if ckpt.format == "safetensors":
        root = _load_safetensors(ckpt.path, map_location, resolved)
        mapped = False
    elif ckpt.format in ("torch-zip", "torch-legacy", "torch-tar"):
        mapped = mmap and ckpt.format == "torch-zip"  # torch maps zip files only
        root = _torch_load(ckpt.path, torch_location, mapped, bool(ckpt.unsafe_globals))
    elif ckpt.format == "hf-sharded":
        return _load_shards(ckpt, map_location, mmap)
    else:
        raise UnsupportedFormatError(f"{ckpt.path!r}: cannot load format {ckpt.format!r}")
    placements = recorder.placements() if recorder else _placements(ckpt, resolved or {})
    return root, placements, mapped


def _load_shards(
    ckpt: Checkpoint, map_location: MapLocation, mmap: bool
) -> tuple[Any, tuple[StorageMove, ...], bool]:
    loaded: list[Any] = []
    totals: dict[tuple[str, str], list[int]] = {}
    mapped = False
    for sub in ckpt.shards.values():
        shard_root, placements, sub_mapped = _load_root(sub, map_location, mmap)
        loaded.append(shard_root)
        mapped = mapped or sub_mapped
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
    return root, merged, mapped


def _modules_as_state_dicts(node: Any, depth: int = 0) -> Any:
    """``node`` with each ``nn.Module`` in its mappings replaced by its state dict (a few
    levels deep), for the choice of the state dict only."""
    if isinstance(node, torch.nn.Module):
        return node.state_dict()
    if isinstance(node, Mapping) and depth < 4:
        return {k: _modules_as_state_dicts(v, depth + 1) for k, v in node.items()}
    return node


def _state_dict_at(root: Any, path: tuple[str, ...], where: str) -> Mapping[Any, Any]:
    # The path was resolved on the torch-free tree: the loaded tree must hold it too, with
    # objects as real objects (their attributes followed as the stand-ins' were).
    walk = walk_path(root, path)
    if not walk.found:
        raise UnsupportedFormatError(
            f"{where}: cannot follow {'.'.join(path)!r} in the loaded object at {walk.rest[0]!r}",
            path=where,
        )
    if isinstance(walk.node, torch.nn.Module):
        # A pickled module (torch.save(model)): its state dict, as the torch-free path
        # recovers it, not its attributes.
        return walk.node.state_dict()
    state_dict = mapping_at(walk.node)
    if state_dict is None:
        raise UnsupportedFormatError(
            f"{where}: {'.'.join(path)!r} loaded as a {type(walk.node).__name__}, not a mapping",
            path=where,
            remedies=(
                Remedy("select", "'a.b'", flag="--select a.b", text="to pick another entry"),
            ),
        )
    return state_dict
