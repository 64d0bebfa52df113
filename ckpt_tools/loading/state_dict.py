"""Loading checkpoints on any device, and into models whatever their wrappers.

:func:`load_state_dict` opens the file with the torch-free reader, selects the model's
state dict there, works out where each storage should go (``map_location="auto"``: where
it was saved when that device exists here, else an existing GPU, else the CPU), and builds
only that state dict's tensors from the reader's descriptors
(:mod:`ckpt_tools.loading.from_reader`: records read, as ``torch.load`` reads them; with
``mmap=True``, zip and safetensors records memory-mapped). No pickle is unpickled again and
``torch.load`` is never called, except with ``trust=True`` on a file that holds a pickle,
which hands it to ``torch.load(weights_only=False)``.

:func:`ckpt_tools.loading.into_module.load_into` builds on it to load into wrapped or plain models.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ckpt_tools._escape import shell_path, shell_word, shown
from ckpt_tools._types import MapLocation, Select, StrPath, checked_flags
from ckpt_tools.descriptors import Opaque
from ckpt_tools.errors import (
    Remedy,
    SelectError,
    UnsupportedFormatError,
    UsageError,
)
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.formats.log import logger
from ckpt_tools.loading.devices import auto_location, checked_device, resolve_map_location
from ckpt_tools.loading.extras import require_torch
from ckpt_tools.loading.results import LoadInfo, StorageMove
from ckpt_tools.structure.modules import module_globals
from ckpt_tools.structure.paths import is_tensor, parse_select, resolve_path
from ckpt_tools.structure.selection import (
    Selection,
    a_kind_of,
    holds_no_state_dict,
    select_state_dict,
    unbuilt_holders,
)
from ckpt_tools.structure.tensor_walk import iter_tensors

if TYPE_CHECKING:  # torch and the modules that import it load when a load runs
    import torch

    from ckpt_tools.loading.storages import Restore

__all__ = [
    "LoadInfo",
    "MapLocation",
    "StorageMove",
    "auto_location",
    "load_state_dict",
    "load_with_info",
    "resolve_map_location",
]


# ---------------------------------------------------------------------------------------
# Where storages go


def _describe(map_location: MapLocation) -> str:
    import torch

    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        return f"<callable {getattr(map_location, '__qualname__', type(map_location).__name__)}>"
    if isinstance(map_location, Mapping):
        return repr(dict(map_location))
    return str(map_location)


# ---------------------------------------------------------------------------------------
# load_state_dict


def _mappable(ckpt: Checkpoint, mmap: bool | Literal["staged"], trusted: bool) -> bool:
    """Whether to map ``ckpt``: not where a storage record is compressed (re-zipped with
    deflate) and the mapping was only staging; refused there before torch.load maps the
    compressed bytes as values (the own reader refuses the selected storages as it meets
    them)."""
    if not mmap:
        return False
    from ckpt_tools.loading.storages import deflated_records, unmappable

    deflated = deflated_records(ckpt)
    if deflated and mmap == "staged":
        return False
    if deflated and trusted:
        sub, record, _ = deflated[0]
        raise unmappable(sub.path, record)
    return True


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
            remedies=(Remedy(command=f"ckpt inspect {shell_path(ckpt.path)}", text="to see it"),),
        )


def _unsafe_remedies(ckpt: Checkpoint, names: Sequence[str]) -> tuple[Remedy, ...]:
    allow = " ".join(f"--allow-global {shell_word(g)}" for g in names)
    out = os.path.splitext(ckpt.path.rstrip("/"))[0] + ".safetensors"
    return (
        Remedy("trust", "True", text="if you trust the file"),
        Remedy(
            command=f"ckpt convert {shell_path(ckpt.path)} {shell_path(out)} --drop-extras {allow}",
            text="to keep only the tensors, without running anything",
        ),
    )


def _restorer(
    map_location: MapLocation, tags: Sequence[str]
) -> tuple[Restore, Callable[[], tuple[StorageMove, ...]]]:
    """Where each storage goes (torch's own ``default_restore_location`` moves it), and a
    function that says where they went."""
    from torch.serialization import default_restore_location

    from ckpt_tools.loading.storages import placed_storage

    resolved = resolve_map_location(map_location, tags)
    seen: dict[tuple[str, str], list[int]] = {}

    def restore(storage: torch.UntypedStorage, tag: str) -> torch.UntypedStorage:
        if resolved is None:
            # A callable gets the CPU storage and the saved tag; None means "where saved".
            result = map_location(storage, tag)  # type: ignore[operator]
            if result is None:  # torch restores it where saved: a device that must exist
                result = default_restore_location(storage, checked_device(tag, tag, map_location))
            target = str(placed_storage(result, storage, tag).device)
        else:
            target = resolved.get(tag)
            if target is None:  # a tag seen only inside a rebuild's arguments
                target = (resolve_map_location(map_location, [tag]) or {}).get(tag, tag)
            result = default_restore_location(storage, target)
        entry = seen.setdefault((tag, target), [0, 0])
        entry[0] += 1
        entry[1] += storage.nbytes()
        return result

    def placements() -> tuple[StorageMove, ...]:
        return tuple(StorageMove(s, t, n, b) for (s, t), (n, b) in seen.items())

    return restore, placements


def _load_own(
    ckpt: Checkpoint, selection: Selection, map_location: MapLocation, mmap: bool
) -> tuple[dict[Any, Any], tuple[StorageMove, ...], bool]:
    """The selected state dict built from our own reader (no pickle is run)."""
    from ckpt_tools.loading.from_reader import build_state_dict, unsafe_entries

    tags = list(dict.fromkeys(t.device for _, t in iter_tensors(selection.state_dict)))
    restore, placements = _restorer(map_location, tags)
    names = tuple(dict.fromkeys(n for _, n in unsafe_entries(selection.state_dict)))
    state_dict, mapped = build_state_dict(
        ckpt, selection.state_dict, restore, ckpt.path, _unsafe_remedies(ckpt, names), mmap=mmap
    )
    return state_dict, placements(), mapped


def _holds_pickle(ckpt: Checkpoint) -> bool:
    # Only a pickle can name code to run: trust changes nothing for safetensors files.
    files = ckpt.shards.values() if ckpt.shards else (ckpt,)
    return any(sub.format != "safetensors" for sub in files)


def _selection_checked(root: Any, select: Select, where: str, trusted: bool) -> Selection | None:
    """The state dict chosen in the torch-free tree; None where ``trusted`` leaves the choice
    to the object ``torch.load`` builds: the tree holds objects of classes the reader did not
    import (a dict subclass where the state dict is), which only that object shows."""
    if trusted and module_globals(root):
        return None
    trust = Remedy("trust", "True", text="if you trust the file: torch.load then builds it")
    try:
        selection = select_state_dict(root, select=select)
    except SelectError as e:
        node = _node_at(root, select)
        if not isinstance(node, Opaque):
            raise
        raise SelectError(
            f"{where}: the entry {select!r} is {a_kind_of(node)}, a class torch.load builds "
            "only when trusted",
            remedies=(trust,),
        ) from e
    unfound = selection.stand_in or (select is None and not selection.found)
    if selection.stand_in:
        # torch.load(weights_only=True) builds a bare tensor or a list, not an object of a
        # class outside its allowlist: only trust builds that.
        remedy = (
            trust
            if isinstance(root, Opaque)
            else Remedy(text="load it with torch.load(path, weights_only=True)")
        )
        raise UsageError(holds_no_state_dict(where, root), remedies=(remedy,))
    held = isinstance(root, Mapping) and any(is_tensor(v) for v in root.values())
    if unfound and held and not unbuilt_holders(root):
        # Weights beside scalars ({"fc.weight": ..., "epoch": 12}), as torch.load gives them;
        # an unbuilt object holding tensors may be the state dict, which only trust shows.
        return Selection((), "the root holds the tensors, beside other entries", root)
    if unfound:
        top = list(root)[:12] if isinstance(root, Mapping) else []
        # An entry of a class outside the allowlist (a dict subclass) may be the state dict.
        built = [k for k in top if isinstance(root[k], Opaque)]
        pick = Remedy("select", "'a.b'", flag="--select a.b", text="to pick one")
        note = f" ({', '.join(shown(str(k)) for k in built)}: objects of their own class)"
        raise UsageError(
            f"{where}: no entry looks like a state dict (a mapping of names to tensors); "
            f"top-level entries: {', '.join(shown(str(k)) for k in top) or 'none'}"
            + (note if built else ""),
            remedies=(trust, pick) if built else (pick,),
        )
    return selection


def _node_at(root: Any, select: Select) -> Any:
    """What ``select`` names in ``root``, or None where it names nothing."""
    parts = parse_select(select)
    try:
        return None if parts is None else resolve_path(root, parts).node
    except SelectError:
        return None


@checked_flags
def load_state_dict(
    path: StrPath,
    *,
    map_location: MapLocation = "auto",
    select: Select = None,
    trust: bool = False,
    mmap: bool = False,
) -> dict[str, torch.Tensor]:
    """Load a checkpoint's state dict on any machine, safely.

    The file is opened with the torch-free reader (nothing in it runs) and the state dict
    is selected there; ``map_location`` then decides where each storage goes, and targets
    that do not exist here are refused before any byte is loaded. Only the selected state
    dict's tensors are built, from the reader's descriptors: records read with ``pread``
    into memory of their own, as ``torch.load`` reads them (``mmap=True`` maps them
    instead); shared storages, strides, views,
    ``nn.Parameter`` and ``requires_grad`` as ``torch.load(weights_only=True)`` gives them.
    Objects of classes outside the allowlist *elsewhere* in the file (hyper-parameters,
    optimizer extras) are never built and do not stop the load. Devices that changed are
    logged on the ``ckpt_tools`` logger (INFO); :func:`load_with_info` also returns them.

    Args:
        path: a checkpoint file (torch zip, legacy, safetensors) or a sharded folder.
        map_location: ``"auto"`` (default): each storage on its saved device when that
            exists, ``cuda:N`` beyond the visible GPUs on ``cuda:{N % count}``, GPU
            storages on the CPU when there is no GPU. Or anything ``torch.load`` takes: a
            device string, a ``torch.device``, a dict of tags (``{"cuda:1": "cuda:0"}``),
            a callable ``(storage, tag) -> storage | None``; ``None`` keeps saved devices.
        select: dotted path to the state dict (``"model.ema"``); default: chosen as
            :func:`ckpt_tools.select_state_dict` does.
        trust: unpickle everything (``torch.load(weights_only=False)``): runs code named
            in the file. The one way to run a file's code; needed only when the state dict
            itself holds objects outside the allowlist (custom classes as extra state) or
            tensors this loader does not build (nested tensors, tensor subclasses).
            Safetensors files hold no pickle: they are read the same either way.
        mmap: as ``torch.load``'s ``mmap``: memory-map torch zip and safetensors records
            instead of reading them (private, page-cache backed: no copy in anonymous
            memory; writes to a tensor never reach the file). The file must then not change
            while the tensors live: rewriting it in place changes their values, and
            truncating it (``torch.save`` to the same path) makes reading them fail with
            SIGBUS. Legacy and tar records are read either way; a re-zipped archive's
            compressed records cannot be mapped and are refused.

    Returns:
        The state dict, as loaded (``_metadata`` kept).

    Raises:
        MissingExtraError: torch is not installed (``pip install 'ckpt_tools[torch]'``).
        UnsafeContentError: the state dict holds objects of globals outside the allowlist
            (all named) and no ``trust=True``.
        UsageError: ``map_location`` names a device that does not exist here, a callable
            ``map_location`` returns something torch.load refuses (no untyped storage, too
            few bytes), ``mmap=True`` meets a compressed (re-zipped) storage record, or
            nothing looks like a state dict (a root that is an empty dict loads as ``{}``).
        SelectError: ``select`` names a missing entry.
        UnsupportedFormatError: a TorchScript archive or a plain pickle; with ``trust=True``,
            a file naming code that cannot be imported here.
        CheckpointError: the file is missing, truncated or malformed.

    Example:
        >>> sd = load_state_dict("ddp.pt", map_location="cpu")
        >>> sd["module.conv.weight"].shape
        torch.Size([8, 3, 3, 3])
    """
    return load_state(path, map_location, select, trust, mmap, "load_state_dict")[0]


@checked_flags
def load_with_info(
    path: StrPath,
    *,
    map_location: MapLocation = "auto",
    select: Select = None,
    trust: bool = False,
    mmap: bool = False,
) -> tuple[dict[str, torch.Tensor], LoadInfo]:
    """:func:`load_state_dict`, and what it did: where storages went, what was selected.

    Args:
        path, map_location, select, trust, mmap: as for :func:`load_state_dict`.

    Returns:
        ``(state_dict, info)``: the state dict as :func:`load_state_dict` returns it, and a
        :class:`LoadInfo` (the state dict's path and why it was chosen, each storage's saved
        and target device, memory-mapped or read, trusted or not).

    Raises:
        As :func:`load_state_dict`.

    Example:
        >>> from ckpt_tools import retag
        >>> _ = retag("model.pt", "gpu1.pt", mapping={"cpu": "cuda:1"})  # as if saved on GPU 1
        >>> sd, info = load_with_info("gpu1.pt", map_location="cpu")
        >>> [(p.saved, p.target) for p in info.moved], sd["conv.weight"].device
        ([('cuda:1', 'cpu')], device(type='cpu'))
    """
    return load_state(path, map_location, select, trust, mmap, "load_with_info")


def load_state(
    path: StrPath,
    map_location: MapLocation,
    select: Select,
    trust: bool,
    mmap: bool | Literal["staged"],
    feature: str,
) -> tuple[dict[str, torch.Tensor], LoadInfo]:
    """The one load the public calls make; ``feature`` names the caller to a missing extra.

    ``mmap="staged"``: map the file as a staging area where it can be (``load_into``
    copies the values out), read it where a storage record is compressed.
    """
    torch = require_torch(feature)
    ckpt = open_checkpoint(path)
    _check_format(ckpt)
    where = ckpt.path
    state_dict: Mapping[Any, Any]
    trusted = trust and _holds_pickle(ckpt)
    chosen = _selection_checked(ckpt.root, select, where, trusted)
    mmap = _mappable(ckpt, mmap, trusted)
    if trusted:
        from ckpt_tools.loading.trusted_load import load_trusted

        state_dict, placements, mapped, selection = load_trusted(
            ckpt, map_location, chosen, select, mmap
        )
    else:
        assert chosen is not None  # only a trusted load leaves the choice to torch.load
        selection = chosen
        state_dict, placements, mapped = _load_own(ckpt, selection, map_location, mmap)
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
    info = LoadInfo(
        path=where,
        format=ckpt.format,
        selected=selection.path,
        selection_reason=selection.reason,
        map_location=_describe(map_location),
        placements=placements,
        mmap=mapped,
        trusted=trusted,
        tensors=sum(isinstance(v, torch.Tensor) for v in state_dict.values()),
    )
    return state_dict, info
