"""Building a state dict's torch objects from the torch-free reader's descriptors.

:func:`build_state_dict` turns the selected mapping of an opened :class:`Checkpoint` into
what ``torch.load(weights_only=True)`` gives for it, without unpickling anything again:

- storages come from :mod:`ckpt_tools.loading.storages` (read; with ``mmap=True``, zip and
  safetensors records memory-mapped as ``torch.load(mmap=True)`` maps them);
- each storage is built once, so tensors that shared one in the file (tied weights, views)
  share it again; a legacy storage view is a slice of its root, as torch makes it;
- storages go where ``map_location`` says through torch's own ``default_restore_location``
  (a callable gets the CPU storage and the saved tag, as with ``torch.load``);
- tensors get the saved dtype, shape, strides, offset, ``requires_grad``, tensor metadata
  (conjugate and negative bits) and ``nn.Parameter``-ness; ``_metadata`` is kept;
- sparse, meta, nested and jagged nested tensors are built by torch's own rebuilds from
  their built parts, a nested or jagged one's bounds checked first (torch does not check
  them, and its kernels would read past the storage);
- a jagged tensor's ``_DimRange`` objects are torch._dynamo's own, imported only for them;
- a tensor of a backend without storages (``xla``, ``mtia``) is its CPU copy moved to
  where ``map_location`` sends its saved tag (torch refuses a callable there; it is asked
  as for a storage).

Objects of classes outside the allowlist inside the selected mapping are refused, all of
them named in one error; anything outside it is never looked at.
"""

from __future__ import annotations

import warnings
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.nested._internal.nested_tensor import NestedTensor, _rebuild_njt

from ckpt_tools.descriptors import RebuiltTensor, StorageRef, TensorRef
from ckpt_tools.errors import (
    CorruptCheckpointError,
    Remedy,
    UnsafeContentError,
    UnsupportedFormatError,
)
from ckpt_tools.formats import Checkpoint
from ckpt_tools.formats.pickle.jagged import check_jagged_parts, jagged_arguments
from ckpt_tools.formats.pickle.standins import ConstantRef, DimRange, Reduced, TorchSize
from ckpt_tools.loading.rebuilds import DEVICE_TENSOR, TENSOR_CALLS, dim_range
from ckpt_tools.loading.storages import Restore, StorageBuilder
from ckpt_tools.loading.tensor_io import torch_dtype
from ckpt_tools.loading.unsafe import from_type, unsafe_entries

__all__ = ["build_state_dict", "unsafe_entries"]

_PARAMETER_TYPES = frozenset({"torch.nn.parameter.Parameter", "torch.nn.Parameter"})
_TENSOR_TYPES = _PARAMETER_TYPES | {"torch.Tensor", "torch._tensor.Tensor"}


# ---------------------------------------------------------------------------------------
# Building the tree


class _Builder:
    def __init__(self, storages: StorageBuilder, where: str) -> None:
        self.storages = storages
        self.where = where
        self.memo: dict[int, Any] = {}
        self.sparse = False  # built a sparse tensor: torch's validation runs at the end

    def build(self, node: Any, path: str) -> Any:
        """``node`` as torch.load builds it; each node once (shared nodes stay shared).

        A stack, not recursion: torch.load reads a pickle however deep its containers nest.
        A container's children are built first (their results on ``built``), then the
        container from them; a mapping or list exists before its children, so a cycle back
        to it finds it.
        """
        built: list[Any] = []
        # (node, path, None) to visit; (node, path, n) once its n children are built.
        todo: list[tuple[Any, str, int | None]] = [(node, path, None)]
        while todo:
            item, where, count = todo.pop()
            if count is not None:
                parts = built[len(built) - count :]
                del built[len(built) - count :]
                built.append(self._finish(item, where, parts))
                self.memo[id(item)] = built[-1]
                continue
            done = self.memo.get(id(item))
            if done is not None:
                built.append(done)
                continue
            children = self._children(item, where)
            if children is None:
                built.append(self._leaf(item, where))
                if not isinstance(item, (str, bytes, int, float, complex, bool, type(None))):
                    self.memo[id(item)] = built[-1]
                continue
            todo.append((item, where, len(children)))
            todo.extend((c, p, None) for c, p in reversed(children))
        return built[0]

    def _children(self, node: Any, path: str) -> list[tuple[Any, str]] | None:
        """What ``node`` is built from, with their paths; None for a node built as it is.

        A mapping or list is made (and memoized) here, before its children.
        """
        if isinstance(node, TensorRef):
            quantizer = node.func is not None and node.func.name == "_rebuild_qtensor"
            state = [(value, f"{path}.{name}") for name, value in node.attributes.items()]
            return [(node.args[4], path), *state] if quantizer else state
        if isinstance(node, TorchSize):
            return None  # a tuple, built as torch.Size
        if isinstance(node, Mapping):
            self.memo[id(node)] = type(node)() if type(node) in _MAPPINGS else {}
            children: list[tuple[Any, str]] = []
            for key, value in node.items():
                if not isinstance(key, (str, int)):  # a tensor may be a key, built as any other
                    children.append((key, path))
                children.append((value, f"{path}.{key}" if path else str(key)))
            # BUILD state the pickle set on the mapping: the state dict's ``_metadata``.
            return children + [(v, path) for v in getattr(node, "__dict__", {}).values()]
        if isinstance(node, list):
            self.memo[id(node)] = []
        if isinstance(node, (list, tuple, set, frozenset)):
            return [(v, f"{path}.{i}") for i, v in enumerate(node)]
        if isinstance(node, RebuiltTensor) and node.layout == "jagged":
            # Its constructor's keywords, then (saved by torch.save) the attributes it sets.
            state = node.args[3:] if node.func.name == "_rebuild_from_type_v2" else ()
            return [(jagged_arguments(node), path), *((s, path) for s in state)]
        if isinstance(node, Reduced):
            return [(node.args, path)]
        return None

    def _finish(self, node: Any, path: str, parts: list[Any]) -> Any:
        """``node`` built from its children's results (in :meth:`_children`'s order)."""
        if isinstance(node, TensorRef):
            return self.tensor(node, path, parts)
        if isinstance(node, Mapping):
            out, values = self.memo[id(node)], iter(parts)
            for key in node:
                built_key = key if isinstance(key, (str, int)) else next(values)
                out[built_key] = next(values)
            for name in getattr(node, "__dict__", {}):
                setattr(out, name, next(values))
            return out
        if isinstance(node, list):
            self.memo[id(node)].extend(parts)
            return self.memo[id(node)]
        if isinstance(node, (tuple, set, frozenset)):
            return type(node)(parts)
        if isinstance(node, RebuiltTensor) and node.layout == "jagged":
            return self.jagged(node, path, parts)
        return self.reduced(node, parts[0], path)

    def _leaf(self, node: Any, path: str) -> Any:
        if isinstance(node, TorchSize):
            return torch.Size(node)
        if isinstance(node, ConstantRef):
            return self.constant(node, path)
        if isinstance(node, DimRange):
            return dim_range(node)
        if isinstance(node, StorageRef):
            raise UnsupportedFormatError(
                f"{self.where}: entry {path!r} is a bare storage, not a tensor; load it with "
                "trust=True",
                path=self.where,
            )
        return node  # str, bytes, numbers, None: as unpickled

    def constant(self, node: ConstantRef, path: str) -> Any:
        value = getattr(torch, node.name, None) if node.module == "torch" else None
        if isinstance(value, (torch.dtype, torch.qscheme)):
            return value
        raise UnsupportedFormatError(
            f"{self.where}: entry {path!r} is the global {node.qualname} itself; load it with "
            "trust=True",
            path=self.where,
        )

    def qtensor(
        self, ref: TensorRef, storage: torch.UntypedStorage, path: str, params: Any
    ) -> torch.Tensor:
        # torch's own rebuild, called with the real storage and the built quantizer params
        # (a qscheme and numbers, or tensors of scales and zero points): nothing unpickled.
        typed = torch.storage.TypedStorage(
            wrap_storage=storage, dtype=getattr(torch, ref.dtype), _internal=True
        )
        with self.rebuilding(path, "quantized tensor"), warnings.catch_warnings():
            # torch's rebuild asks the TypedStorage for its device
            warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
            return torch._utils._rebuild_qtensor(
                typed, ref.offset, ref.shape, ref.stride, params, False, OrderedDict()
            )

    @contextmanager
    def rebuilding(self, path: str, what: str) -> Iterator[None]:
        """torch's rebuild of entry ``path`` refusing its arguments: one line naming it."""
        try:
            yield
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise CorruptCheckpointError(
                f"{self.where}: entry {path!r}: torch cannot rebuild this {what} ({e})",
                path=self.where,
            ) from e

    def jagged(self, node: RebuiltTensor, path: str, parts: list[Any]) -> torch.Tensor:
        """The jagged nested tensor ``node`` describes, from its constructor's keywords and
        (saved by torch.save) its attribute state, built: torch's own calls make it."""
        kwargs = parts[0]
        values, offsets, lengths = kwargs["values"], kwargs["offsets"], kwargs.get("lengths")
        # torch's constructor does not look at the offsets' numbers, and its kernels index
        # the values with them: a component past the values is refused before torch sees it.
        # Parts mapped to the meta device hold no numbers, and nothing to read past.
        if not offsets.is_meta and (lengths is None or not lengths.is_meta):
            try:
                check_jagged_parts(values, offsets, lengths, kwargs.get("_ragged_idx", 1))
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"{self.where}: entry {path!r} is a jagged nested tensor whose offsets do not "
                    f"delimit components of its values ({e})",
                    path=self.where,
                ) from e
        with self.rebuilding(path, "jagged nested tensor"):
            if len(parts) == 1:  # a bare _rebuild_njt call
                return _rebuild_njt(kwargs)
            # as torch.load calls it: the constructor, then the state set as attributes
            return torch._tensor._rebuild_from_type_v2(
                _rebuild_njt, NestedTensor, (kwargs,), parts[1]
            )

    def reduced(self, node: Reduced, args: tuple[Any, ...], path: str) -> Any:
        """The result of the recorded call ``node``, its arguments built as ``args``."""
        name = node.func.qualname
        if name == "torch.device":
            return torch.device(*args)
        if name == "torch.serialization._get_layout" and args and isinstance(args[0], str):
            layout = getattr(torch, args[0].removeprefix("torch."), None)
            if isinstance(layout, torch.layout):
                return layout
        if name == DEVICE_TENSOR:
            return self.device_tensor(args, path)
        if name in TENSOR_CALLS:
            self.sparse = self.sparse or name == "torch._utils._rebuild_sparse_tensor"
            with self.rebuilding(path, f"tensor with {name}"):
                return TENSOR_CALLS[name](*args)
        raise UnsupportedFormatError(
            f"{self.where}: entry {path!r} is built by {name}, which this loader does not "
            "build (tensor subclasses); load it with trust=True",
            path=self.where,
        )

    def device_tensor(self, args: tuple[Any, ...], path: str) -> torch.Tensor:
        """A tensor of a backend without storages (``xla``, ``mtia``): its CPU copy, moved.

        torch maps the saved device tag through ``map_location`` and calls ``data.to``; the
        tag goes here where a storage saved with it would go (an empty one is placed).
        """
        data, dtype, device, requires_grad = args
        if not isinstance(data, torch.Tensor):
            raise CorruptCheckpointError(
                f"{self.where}: entry {path!r}: the CPU copy of a device tensor is a "
                f"{type(data).__name__}, not a tensor; torch.load fails on it too",
                path=self.where,
            )
        target = self.storages.restore(torch.UntypedStorage(0), device).device
        with self.rebuilding(path, f"tensor for device {device!r}"):
            # torch's own rebuild, with the tag already mapped: its call would map it again
            # through whatever map_location the last torch.load of this thread left set.
            tensor = data.to(dtype=dtype, device=target)
            tensor.requires_grad = requires_grad
            return tensor

    def tensor(self, ref: TensorRef, path: str, parts: list[Any]) -> torch.Tensor:
        """The tensor ``ref`` describes; ``parts``: its quantizer parameters (a quantized
        tensor), then its attribute values, built."""
        storage = self.storages.storage(ref.storage)
        values = iter(parts)
        if ref.func is not None and ref.func.name == "_rebuild_qtensor":
            tensor = self.qtensor(ref, storage, path, next(values))
        else:
            tensor = torch.empty((0,), dtype=torch_dtype(ref.dtype), device=storage.device)
            tensor.set_(storage, ref.offset, ref.shape, ref.stride)
        if ref.view_bits:  # as torch._utils.set_tensor_metadata sets them
            torch._C._set_tensor_metadata(tensor, dict.fromkeys(ref.view_bits, True))
        rebuilt_as, new_type, _, _ = from_type(ref)
        if rebuilt_as and new_type.qualname not in _TENSOR_TYPES:
            raise UnsupportedFormatError(
                f"{self.where}: entry {path!r} is a {new_type.qualname}, a tensor subclass "
                "this loader does not build; load it with trust=True",
                path=self.where,
            )
        if ref.is_parameter:
            tensor = torch.nn.Parameter(tensor, requires_grad=ref.requires_grad)
        else:
            tensor.requires_grad = ref.requires_grad
        for name in ref.attributes:  # as torch._utils._set_obj_state sets them
            setattr(tensor, name, next(values))
        return tensor


_MAPPINGS = (dict, OrderedDict, Counter)


def build_state_dict(
    ckpt: Checkpoint,
    state_dict: Mapping[Any, Any],
    restore: Restore,
    where: str,
    remedies: tuple[Remedy, ...] = (),
    *,
    mmap: bool = False,
) -> tuple[Any, bool]:
    """The torch objects of ``state_dict`` (a mapping of ``ckpt``'s tree), and whether any
    storage was memory-mapped.

    Args:
        ckpt: the opened checkpoint.
        state_dict: the selected mapping, inside ``ckpt.root``.
        restore: where each storage goes (see :data:`Restore`).
        where: the file, for messages.
        remedies: attached to the refusal of objects outside the allowlist.
        mmap: map torch zip and safetensors records rather than read them.

    Returns:
        ``(mapping, mapped)``: a dict or OrderedDict as torch would load it.

    Raises:
        UnsafeContentError: the mapping holds objects of classes outside the allowlist.
        UnsupportedFormatError: it holds what this loader does not build (tensor subclasses,
            bare storages): ``trust=True`` loads those with ``torch.load``.
        CorruptCheckpointError: a storage's bytes lie outside the file, a nested tensor's
            components lie outside its buffer or values, or torch's own rebuild refuses a
            quantized, sparse, nested or jagged tensor.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> sd, mapped = build_state_dict(ckpt, ckpt.root, lambda s, t: s, "model.pt", mmap=True)
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
    with StorageBuilder(ckpt, restore, mmap=mmap) as storages:
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
