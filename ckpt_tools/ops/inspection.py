"""``inspect``: what a checkpoint holds, from its structure alone. Never imports torch."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.formats.allowlist import Reduced, TorchSize
from ckpt_tools.structure.keys import WrapperMatch, detect_wrappers
from ckpt_tools.structure.selection import Selection, select_state_dict
from ckpt_tools.descriptors import Opaque, TensorRef, short_repr

__all__ = [
    "CheckpointInfo",
    "TensorInfo",
    "describe_value",
    "inspect",
    "inspect_checkpoint",
    "script_module_tensors",
]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the selected state dict.

    Attributes:
        name: its key.
        dtype: torch dtype name without ``torch.``.
        shape: sizes.
        stride: strides in elements.
        numel: element count.
        nbytes: bytes its elements take.
        device: saved device tag.
        storage: storage key; tensors with the same key share memory.
        offset: storage offset in elements.
        storage_nbytes: the whole storage's size.
        shared_with: other keys of the state dict viewing the same storage.
        is_parameter: saved as ``nn.Parameter``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    nbytes: int
    device: str
    storage: str
    offset: int
    storage_nbytes: int
    shared_with: tuple[str, ...] = ()
    is_parameter: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "numel": self.numel,
            "nbytes": self.nbytes,
            "device": self.device,
            "storage": self.storage,
            "offset": self.offset,
            "storage_nbytes": self.storage_nbytes,
            "shared_with": list(self.shared_with),
        }


@dataclass(frozen=True)
class CheckpointInfo:
    """The result of :func:`inspect`.

    Attributes:
        path: the file or folder.
        format: see :data:`ckpt_tools.formats.FORMATS`.
        selected: keys leading to the chosen state dict (``()`` for the root).
        selection_reason: why it was chosen.
        tensors: the state dict's tensors, in key order.
        wrappers: wrapper prefixes found in its keys.
        unsafe_globals: globals outside the allowlist (never imported).
        entries: non-tensor entries beside the state dict, summarised (``{"epoch": "int 3"}``),
            plus non-tensor values inside it.
        total_params: elements over all tensors.
        total_bytes: bytes over all tensors.
        storage_bytes: bytes of the distinct storages they view (shared memory counted once).
        metadata: safetensors ``__metadata__`` or a shard index's ``metadata``.
        shards: shard file names, for sharded folders.
    """

    path: str
    format: str
    selected: tuple[str, ...]
    selection_reason: str
    tensors: tuple[TensorInfo, ...]
    wrappers: tuple[WrapperMatch, ...]
    unsafe_globals: tuple[str, ...]
    entries: Mapping[str, str]
    total_params: int
    total_bytes: int
    storage_bytes: int
    metadata: Mapping[str, str] | None = None
    shards: tuple[str, ...] = ()
    shard_of: Mapping[str, str] = field(default_factory=dict)

    @property
    def dtypes(self) -> dict[str, int]:
        """dtype -> tensor count."""
        return dict(Counter(t.dtype for t in self.tensors))

    @property
    def devices(self) -> dict[str, int]:
        """saved device tag -> tensor count."""
        return dict(Counter(t.device for t in self.tensors))

    def to_json(self) -> dict[str, Any]:
        """The public ``ckpt inspect --json`` schema (stable fields, plus extras)."""
        return {
            "path": self.path,
            "format": self.format,
            "selected": list(self.selected),
            "selection_reason": self.selection_reason,
            "tensors": [t.to_json() for t in self.tensors],
            "wrappers": [w.to_json() for w in self.wrappers],
            "unsafe_globals": list(self.unsafe_globals),
            "entries": dict(self.entries),
            "total_params": self.total_params,
            "total_bytes": self.total_bytes,
            "storage_bytes": self.storage_bytes,
            "dtypes": self.dtypes,
            "devices": self.devices,
            "metadata": dict(self.metadata) if self.metadata else None,
            "shards": list(self.shards),
        }


def describe_value(value: Any, limit: int = 60) -> str:
    """A short, safe summary of a non-tensor value (``int 3``, ``dict (2 keys: a, b)``)."""
    if isinstance(value, TensorRef):
        return f"tensor {value.dtype} {list(value.shape)}"
    if isinstance(value, Opaque):
        return f"{value.global_ref.qualname} object (not imported)"
    if isinstance(value, type) and issubclass(value, Opaque):
        return f"{value.global_ref.qualname} (global, not imported)"
    if isinstance(value, (Reduced, TorchSize)):
        return _clip(repr(value), limit)
    if isinstance(value, (bool, int, float, complex, str, bytes, bytearray, set, frozenset)):
        # Unpickled values: repr() of a shared-reference bomb or a 5,000-digit int is not safe.
        return f"{type(value).__name__} {short_repr(value, limit)}"
    if isinstance(value, Mapping):
        tensors = sum(isinstance(v, TensorRef) for v in value.values())
        keys = ", ".join(_name(k) for k in list(value)[:4]) + (", ..." if len(value) > 4 else "")
        extra = f", {tensors} tensors" if tensors else ""
        return f"{type(value).__name__} ({len(value)} keys{extra}: {keys})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} ({len(value)} items)"
    return f"{type(value).__name__} {short_repr(value, limit)}"


def _name(key: Any) -> str:
    """A mapping key as text: strings as they are, anything else (unpickled) safely."""
    return key if isinstance(key, str) else short_repr(key, 40)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _entries_beside(
    root: Any, path: Sequence[str], state_dict: Mapping[str, Any]
) -> dict[str, str]:
    entries: dict[str, str] = {}
    node, prefix = root, ""
    for part in path:
        if isinstance(node, Mapping):
            for key, value in node.items():
                if _name(key) != part:
                    entries[f"{prefix}{_name(key)}"] = describe_value(value)
            node = node[part] if part in node else node[int(part)]
        elif isinstance(node, Opaque) and isinstance(node.state, Mapping):
            node = node.state[part]
        prefix = f"{prefix}{part}."
    for key, value in state_dict.items():
        if not isinstance(value, TensorRef):
            entries[f"{prefix}{_name(key)}"] = describe_value(value)
    return entries


def inspect_checkpoint(
    ckpt: Checkpoint, select: str | Sequence[str] | None = None
) -> CheckpointInfo:
    """Describe an opened checkpoint (see :func:`inspect`)."""
    selection = select_state_dict(ckpt.root, select)
    if select is None and ckpt.format == "torchscript" and not selection.path:
        flat = script_module_tensors(ckpt.root)
        if flat:
            selection = Selection((), "TorchScript module: its parameters and buffers", flat)
    sd = selection.state_dict
    by_storage: dict[int, list[str]] = {}
    named = [(str(k), v) for k, v in sd.items() if isinstance(v, TensorRef)]
    for name, tensor in named:
        by_storage.setdefault(id(tensor.storage), []).append(name)
    shard_of = _shard_owner(ckpt)
    tensors = tuple(
        TensorInfo(
            name=name,
            dtype=t.dtype,
            shape=t.shape,
            stride=t.stride,
            numel=t.numel,
            nbytes=t.nbytes,
            device=t.device,
            storage=shard_of.get(name, "") + t.storage.key if shard_of else t.storage.key,
            offset=t.offset,
            storage_nbytes=t.storage.nbytes,
            shared_with=tuple(n for n in by_storage[id(t.storage)] if n != name),
            is_parameter=t.is_parameter,
        )
        for name, t in named
    )
    distinct = {id(t.storage): t.storage.nbytes for _, t in named}
    return CheckpointInfo(
        path=ckpt.path,
        format=ckpt.format,
        selected=selection.path,
        selection_reason=selection.reason,
        tensors=tensors,
        wrappers=detect_wrappers(name for name, _ in named),
        unsafe_globals=ckpt.unsafe_globals,
        entries=_entries_beside(ckpt.root, selection.path, sd),
        total_params=sum(t.numel for t in tensors),
        total_bytes=sum(t.nbytes for t in tensors),
        storage_bytes=sum(distinct.values()),
        metadata=ckpt.metadata,
        shards=tuple(ckpt.shards),
        shard_of=shard_of,
    )


def script_module_tensors(root: Any) -> dict[str, TensorRef]:
    """The tensors of a TorchScript module tree by dotted name, as ``state_dict()`` names them.

    A TorchScript archive pickles each module as an object whose state maps its attribute
    names to tensors, submodules and plain values. Tensor attributes that are neither
    parameters nor buffers are listed too: telling them apart needs the archive's code.
    """
    found: dict[str, TensorRef] = {}
    seen: set[int] = set()

    def walk(node: Any, prefix: str) -> None:
        if id(node) in seen or not isinstance(node, Opaque) or not isinstance(node.state, Mapping):
            return
        seen.add(id(node))
        for key, value in node.state.items():
            if isinstance(value, TensorRef):
                found[f"{prefix}{key}"] = value
            else:
                walk(value, f"{prefix}{key}.")

    walk(root, "")
    return found


def _shard_owner(ckpt: Checkpoint) -> dict[str, str]:
    if not ckpt.shards:
        return {}
    owner: dict[str, str] = {}
    for shard, sub in ckpt.shards.items():
        for name in sub.root if isinstance(sub.root, Mapping) else ():
            owner[str(name)] = f"{shard}:"
    return owner


def inspect(
    path: str | os.PathLike[str], select: str | Sequence[str] | None = None
) -> CheckpointInfo:
    """Describe a checkpoint without importing torch or reading tensor bytes.

    Args:
        path: a checkpoint file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.safetensors``, legacy
            or tar torch files, pickles) or a sharded folder.
        select: a dotted path to the state dict, overriding the automatic choice.

    Returns:
        A :class:`CheckpointInfo`.

    Raises:
        CheckpointError: the file is missing, corrupt, unsupported, or ``select`` is wrong.

    Example:
        >>> info = inspect("model.pt")  # doctest: +SKIP
        >>> info.wrappers[0].prefix, info.total_params  # doctest: +SKIP
        ('module.', 11689512)
    """
    return inspect_checkpoint(open_checkpoint(path), select)
