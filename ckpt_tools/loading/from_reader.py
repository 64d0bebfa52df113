"""Building a state dict's torch objects from the torch-free reader's descriptors.

:func:`build_state_dict` turns the selected mapping of an opened :class:`Checkpoint` into
what ``torch.load(weights_only=True)`` gives for it, without unpickling anything again:

- storages come from :mod:`ckpt_tools.loading.storages` (zip and safetensors records
  memory-mapped as ``torch.load(mmap=True)`` maps them, legacy and tar records read);
- each storage is built once, so tensors that shared one in the file (tied weights, views)
  share it again; a legacy storage view is a slice of its root, as torch makes it;
- storages go where ``map_location`` says through torch's own ``default_restore_location``
  (a callable gets the CPU storage and the saved tag, as with ``torch.load``);
- tensors get the saved dtype, shape, strides, offset, ``requires_grad``, tensor metadata
  (conjugate and negative bits) and ``nn.Parameter``-ness; ``_metadata`` is kept.

Objects of classes outside the allowlist inside the selected mapping are refused, all of
them named in one error; anything outside it is never looked at.
"""

from __future__ import annotations

import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ckpt_tools.descriptors import Opaque, StorageRef, TensorRef
from ckpt_tools.errors import (
    CorruptCheckpointError,
    Remedy,
    UnsafeContentError,
    UnsupportedFormatError,
)
from ckpt_tools.formats import Checkpoint
from ckpt_tools.formats.pickle.standins import ConstantRef, Reduced, TorchSize
from ckpt_tools.loading.storages import Restore, StorageBuilder
from ckpt_tools.loading.tensor_io import torch_dtype

__all__ = ["build_state_dict", "unsafe_entries"]

_PARAMETER_TYPES = frozenset({"torch.nn.parameter.Parameter", "torch.nn.Parameter"})
_TENSOR_TYPES = _PARAMETER_TYPES | {"torch.Tensor", "torch._tensor.Tensor"}


# ---------------------------------------------------------------------------------------
# Refusing what torch.load(weights_only=True) would refuse inside the state dict


def _qualname(node: Any) -> str | None:
    if isinstance(node, Opaque):
        return type(node).global_ref.qualname
    if isinstance(node, type) and issubclass(node, Opaque):
        return node.global_ref.qualname
    return None


def unsafe_entries(node: Any, path: str = "") -> list[tuple[str, str]]:
    """Every ``(entry path, global)`` outside the allowlist inside ``node``.

    Example:
        >>> unsafe_entries({"w": 1, "cfg": {"lr": 0.1}})
        []
    """
    found: list[tuple[str, str]] = []
    seen: set[int] = set()

    def walk(item: Any, where: str) -> None:
        name = _qualname(item)
        if name is not None:
            found.append((where or "<root>", name))
            return
        if id(item) in seen:
            return
        if isinstance(item, Mapping):
            seen.add(id(item))
            for key, value in item.items():
                walk(value, f"{where}.{key}" if where else str(key))
            attributes = getattr(item, "__dict__", None)  # kept alive by the mapping
            if attributes:
                walk(attributes, where)
        elif isinstance(item, (list, tuple, set, frozenset)):
            seen.add(id(item))
            for index, value in enumerate(item):
                walk(value, f"{where}.{index}" if where else str(index))
        elif isinstance(item, TensorRef):
            walk(_from_type(item)[1], where)
            walk(_object_state(item), where)
            if item.func is not None and item.func.name == "_rebuild_qtensor":
                walk(item.args[4:5], where)  # the quantizer parameters
        elif isinstance(item, Reduced):
            walk(item.args, where)

    walk(node, path)
    return found


def _from_type(ref: TensorRef) -> tuple[bool, Any, Any, Any]:
    """``(is it _rebuild_from_type_v2, its new type, inner args, state)``."""
    if ref.func is None or ref.func.name != "_rebuild_from_type_v2" or len(ref.args) != 4:
        return False, None, None, None
    return True, ref.args[1], ref.args[2], ref.args[3]


# ---------------------------------------------------------------------------------------
# Building the tree


class _Builder:
    def __init__(self, storages: StorageBuilder, where: str) -> None:
        self.storages = storages
        self.where = where
        self.memo: dict[int, Any] = {}
        self.sparse = False  # built a sparse tensor: torch's validation runs at the end

    def build(self, node: Any, path: str) -> Any:
        done = self.memo.get(id(node))
        if done is not None:
            return done
        result = self._build(node, path)
        if not isinstance(node, (str, bytes, int, float, complex, bool, type(None))):
            self.memo[id(node)] = result
        return result

    def _build(self, node: Any, path: str) -> Any:
        if isinstance(node, TensorRef):
            return self.tensor(node, path)
        if isinstance(node, TorchSize):
            return torch.Size(node)
        if isinstance(node, Mapping):
            return self.mapping(node, path)
        if isinstance(node, list):
            out: list[Any] = []
            self.memo[id(node)] = out  # before its items: a list may hold itself
            out.extend(self.build(v, f"{path}.{i}") for i, v in enumerate(node))
            return out
        if isinstance(node, (tuple, set, frozenset)):
            return type(node)(self.build(v, f"{path}.{i}") for i, v in enumerate(node))
        if isinstance(node, ConstantRef):
            return self.constant(node, path)
        if isinstance(node, Reduced):
            return self.reduced(node, path)
        if isinstance(node, StorageRef):
            raise UnsupportedFormatError(
                f"{self.where}: entry {path!r} is a bare storage, not a tensor; load it with "
                "trust=True",
                path=self.where,
            )
        return node  # str, bytes, numbers, None: as unpickled

    def mapping(self, node: Mapping[Any, Any], path: str) -> Any:
        out = type(node)() if type(node) in (dict, OrderedDict, Counter) else {}
        self.memo[id(node)] = out
        for key, value in node.items():
            # A tensor may be a key (hashed by identity): it is built like any other.
            built = key if isinstance(key, (str, int)) else self.build(key, path)
            out[built] = self.build(value, f"{path}.{key}" if path else str(key))
        # BUILD state the pickle set on the mapping: the state dict's ``_metadata``.
        for name, value in getattr(node, "__dict__", {}).items():
            setattr(out, name, self.build(value, path))
        return out

    def constant(self, node: ConstantRef, path: str) -> Any:
        value = getattr(torch, node.name, None) if node.module == "torch" else None
        if isinstance(value, (torch.dtype, torch.qscheme)):
            return value
        raise UnsupportedFormatError(
            f"{self.where}: entry {path!r} is the global {node.qualname} itself; load it with "
            "trust=True",
            path=self.where,
        )

    def qtensor(self, ref: TensorRef, storage: torch.UntypedStorage, path: str) -> torch.Tensor:
        # torch's own rebuild, called with the real storage and the built quantizer params
        # (a qscheme and numbers, or tensors of scales and zero points): nothing unpickled.
        typed = torch.storage.TypedStorage(
            wrap_storage=storage, dtype=getattr(torch, ref.dtype), _internal=True
        )
        params = self.build(ref.args[4], path)
        try:
            with warnings.catch_warnings():  # torch's rebuild asks the TypedStorage for its device
                warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
                return torch._utils._rebuild_qtensor(
                    typed, ref.offset, ref.shape, ref.stride, params, False, OrderedDict()
                )
        except (RuntimeError, ValueError, TypeError) as e:
            raise CorruptCheckpointError(
                f"{self.where}: entry {path!r}: torch cannot rebuild this quantized tensor ({e})",
                path=self.where,
            ) from e

    def reduced(self, node: Reduced, path: str) -> Any:
        name = node.func.qualname
        args = self.build(node.args, path)
        if name == "torch.device":
            return torch.device(*args)
        if name == "torch.serialization._get_layout" and args and isinstance(args[0], str):
            layout = getattr(torch, args[0].removeprefix("torch."), None)
            if isinstance(layout, torch.layout):
                return layout
        if name == "torch._utils._rebuild_sparse_tensor":
            # Validated (as torch.load does) once the whole state dict is built.
            self.sparse = True
            try:
                return torch._utils._rebuild_sparse_tensor(*args)
            except (RuntimeError, ValueError, TypeError) as e:
                raise CorruptCheckpointError(
                    f"{self.where}: entry {path!r}: not a sparse tensor torch rebuilds ({e})",
                    path=self.where,
                ) from e
        if name == "torch._utils._rebuild_meta_tensor_no_storage":
            dtype, size, stride, requires_grad = args
            tensor = torch.empty_strided(size, stride, dtype=dtype, device="meta")
            tensor.requires_grad = requires_grad
            return tensor
        raise UnsupportedFormatError(
            f"{self.where}: entry {path!r} is built by {name}, which this loader does not "
            "build (nested or subclass tensors); load it with trust=True",
            path=self.where,
        )

    def tensor(self, ref: TensorRef, path: str) -> torch.Tensor:
        storage = self.storages.storage(ref.storage)
        if ref.func is not None and ref.func.name == "_rebuild_qtensor":
            tensor = self.qtensor(ref, storage, path)
        else:
            tensor = torch.empty((0,), dtype=torch_dtype(ref.dtype), device=storage.device)
            tensor.set_(storage, ref.offset, ref.shape, ref.stride)
        if ref.view_bits:  # as torch._utils.set_tensor_metadata sets them
            torch._C._set_tensor_metadata(tensor, dict.fromkeys(ref.view_bits, True))
        from_type, new_type, _, _ = _from_type(ref)
        if from_type and new_type.qualname not in _TENSOR_TYPES:
            raise UnsupportedFormatError(
                f"{self.where}: entry {path!r} is a {new_type.qualname}, a tensor subclass "
                "this loader does not build; load it with trust=True",
                path=self.where,
            )
        if ref.is_parameter:
            tensor = torch.nn.Parameter(tensor, requires_grad=ref.requires_grad)
        else:
            tensor.requires_grad = ref.requires_grad
        state = _object_state(ref)
        if isinstance(state, tuple) and len(state) == 2:
            # (dict state, slots state), either may be None
            parts = [part for part in state if isinstance(part, Mapping)]
            state = {k: v for part in parts for k, v in part.items()}
        if isinstance(state, Mapping):
            for name, value in state.items():  # as torch._utils._set_obj_state sets them
                setattr(tensor, name, self.build(value, f"{path}.{name}"))
        return tensor


def _object_state(ref: TensorRef) -> Any:
    """The attribute state ``torch._utils._set_obj_state`` would set, if any."""
    name = ref.func.name if ref.func is not None else ""
    if name in ("_rebuild_from_type_v2", "_rebuild_parameter_with_state") and len(ref.args) == 4:
        return ref.args[3]
    return None


def build_state_dict(
    ckpt: Checkpoint,
    state_dict: Mapping[Any, Any],
    restore: Restore,
    where: str,
    remedies: tuple[Remedy, ...] = (),
) -> tuple[Any, bool]:
    """The torch objects of ``state_dict`` (a mapping of ``ckpt``'s tree), and whether any
    storage was memory-mapped.

    Args:
        ckpt: the opened checkpoint.
        state_dict: the selected mapping, inside ``ckpt.root``.
        restore: where each storage goes (see :data:`Restore`).
        where: the file, for messages.
        remedies: attached to the refusal of objects outside the allowlist.

    Returns:
        ``(mapping, mapped)``: a dict or OrderedDict as torch would load it.

    Raises:
        UnsafeContentError: the mapping holds objects of classes outside the allowlist.
        UnsupportedFormatError: it holds what this loader does not build (nested tensors,
            tensor subclasses, bare storages): ``trust=True`` loads those with ``torch.load``.
        CorruptCheckpointError: a storage's bytes lie outside the file, or torch's own
            rebuild refuses a quantized or sparse tensor.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> sd, mapped = build_state_dict(ckpt, ckpt.root, lambda s, tag: s, "model.pt")
        >>> sd["head.weight"].shape, mapped
        (torch.Size([3, 8]), True)
    """
    offenders = unsafe_entries(state_dict)
    if offenders:
        names = tuple(dict.fromkeys(name for _, name in offenders))
        shown = ", ".join(f"{p!r} ({n})" for p, n in offenders[:8])
        more = f" and {len(offenders) - 8} more" if len(offenders) > 8 else ""
        raise UnsafeContentError(
            f"{where}: the state dict holds objects of classes outside the weights-only "
            f"allowlist: {shown}{more}; loading them would import and call "
            f"{', '.join(names)}",
            names,
            path=where,
            remedies=remedies,
        )
    with StorageBuilder(ckpt, restore) as storages:
        mapping = state_dict
        if not isinstance(mapping, (dict, OrderedDict)):
            mapping = dict(mapping)
        builder = _Builder(storages, where)
        built = builder.build(mapping, "")
        if not builder.sparse:
            return built, storages.mapped
        try:
            torch._utils._validate_loaded_sparse_tensors()
        except (RuntimeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{where}: a sparse tensor of the state dict is invalid ({e})", path=where
            ) from e
        return built, storages.mapped
