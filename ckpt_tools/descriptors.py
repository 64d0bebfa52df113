"""The torch-free metadata model: what a checkpoint holds, without its tensor bytes.

Opening a checkpoint builds a tree of plain Python containers (dict, OrderedDict, list,
tuple, str, numbers) whose tensors are :class:`TensorRef` descriptors pointing at
:class:`StorageRef` records, and whose objects of unknown classes are :class:`Opaque`
stand-ins. Nothing here imports torch or reads tensor bytes.

The descriptors remember how they were pickled (the rebuild function and its arguments),
so a writer can re-emit them exactly, changing only what a rewrite asks for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import CorruptCheckpointError

__all__ = [
    "ByteSpan",
    "GlobalRef",
    "Opaque",
    "RebuiltTensor",
    "Reduced",
    "StorageRef",
    "TensorRef",
    "contiguous_stride",
]


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``.

    Example:
        >>> contiguous_stride((2, 3, 4))
        (12, 4, 1)
    """
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class Sealed:
    """Refuses pickle state: a pickle's BUILD opcode cannot edit these frozen descriptors.

    BUILD after a call sets attributes on the object the call made, writing straight into
    ``__dict__`` past ``frozen=True``. On a descriptor the restricted unpickler built, that
    would undo its checks: a rebuilt tensor's geometry, or a global's name (a ``torch.float32``
    renamed ``os.system`` is then re-pickled by a rewrite as a call to ``os.system``). Pickle
    calls ``__setstate__`` when there is one; this one refuses. ``copy`` and ``pickle`` of
    these objects go through :meth:`__reduce__` (the constructor's arguments) instead.
    """

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise CorruptCheckpointError(
            f"the pickle applies state (BUILD) to a {type(self).__name__}, which torch never "
            "writes; refused"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), tuple(getattr(self, f.name) for f in fields(self)))  # type: ignore[arg-type]


@dataclass(frozen=True)
class GlobalRef(Sealed):
    """A Python global named in a pickle (``module.name``), never imported."""

    module: str
    name: str

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    def __str__(self) -> str:
        return self.qualname


@dataclass(frozen=True)
class ByteSpan:
    """Where a storage's bytes live: ``nbytes`` bytes at ``offset`` in the file at ``path``."""

    path: str
    offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class StorageRef(Sealed):
    """One storage record: a flat run of bytes that tensors view.

    Identity matters: two :class:`TensorRef` s share memory exactly when they refer to the
    same ``StorageRef`` object (``eq=False`` makes equality identity).

    Attributes:
        key: the storage's key in its file (``"0"`` for ``archive/data/0``; the tensor name
            for safetensors, where each tensor owns its bytes).
        dtype: element type of the storage as pickled (``uint8`` for untyped storages).
        numel: elements of ``dtype`` in the storage, as pickled.
        device: the saved location tag (``"cpu"``, ``"cuda:1"``).
        storage_type: the storage class the pickle names (``torch.FloatStorage``), or None
            for formats that have no pickle.
        view: legacy (pre-1.6) storage view metadata ``(view_key, offset, numel)``, if any.
    """

    key: str
    dtype: str
    numel: int
    device: str
    storage_type: GlobalRef | None = None
    view: tuple[str, int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def root_span(self) -> tuple[int, int]:
        """``(first byte, end byte)`` of what this reference shows, within its root storage.

        The whole storage, ``(0, nbytes)``, except for a legacy view, which shows its slice:
        a tensor on a view indexes into the view, and a reader locates the view's bytes by
        adding the first byte to where the root storage starts.

        Example:
            >>> StorageRef("0", "float32", 12, "cpu", view=("2", 4, 6)).root_span
            (16, 40)
        """
        if self.view is None:
            return 0, self.nbytes
        size = itemsize(self.dtype)
        return self.view[1] * size, (self.view[1] + self.view[2]) * size


@dataclass(frozen=True, eq=False)
class TensorRef(Sealed):
    """A tensor as a view into a storage.

    Attributes:
        storage: the storage it views.
        offset: storage offset, in elements of ``dtype``.
        shape: sizes.
        stride: strides, in elements.
        dtype: element type.
        requires_grad: as saved.
        is_parameter: saved as ``nn.Parameter``.
        func: the global that rebuilds it (``torch._utils._rebuild_tensor_v2``); None for
            formats without a pickle.
        args: the exact arguments ``func`` was called with, for a faithful re-emit.
    """

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False
    func: GlobalRef | None = None
    args: tuple[Any, ...] = field(default=(), repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @property
    def device(self) -> str:
        return self.storage.device

    @property
    def parameter_data(self) -> TensorRef | None:
        """A Parameter's ``.data``, which torch pickles as a plain tensor inside the
        parameter's ``_rebuild_parameter*`` call; None for anything else."""
        name = self.func.name if self.func is not None else ""
        data = self.args[0] if name.startswith("_rebuild_parameter") and self.args else None
        return data if isinstance(data, TensorRef) else None

    @property
    def attributes(self) -> dict[Any, Any]:
        """The Python attributes its rebuild sets on the tensor (``t.note = ...``), by name, as
        ``torch._utils._set_obj_state`` sets them: a ``(dict, slots)`` pair's two parts as
        one mapping; empty where the rebuild sets none.

        Example:
            >>> s = StorageRef("0", "float32", 2, "cpu")
            >>> TensorRef(s, 0, (2,), (1,), "float32").attributes
            {}
        """
        name = self.func.name if self.func is not None else ""
        with_state = ("_rebuild_from_type_v2", "_rebuild_parameter_with_state")
        state = self.args[3] if name in with_state and len(self.args) == 4 else None
        # A slotted subclass pickles (dict state, slots state), either may be None.
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        return {k: v for part in parts if isinstance(part, Mapping) for k, v in part.items()}

    @property
    def view_bits(self) -> frozenset[str]:
        """The view bits torch sets when it loads this tensor: ``conj``, ``neg``, or none.

        torch.save writes a conjugate or negative view as its storage's bytes plus the bit
        (the rebuild call's ``metadata`` argument, ``{"neg": True}``); torch.load sets the bit,
        so the values are the bytes conjugated or negated. Anything that reads the bytes as
        values must apply them, or refuse.

        Example:
            >>> TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32").view_bits
            frozenset()
        """
        if self.parameter_data is not None:
            return self.parameter_data.view_bits  # the parameter's data was rebuilt first
        name, args = (self.func.name if self.func is not None else ""), self.args
        if name == "_rebuild_from_type_v2" and len(args) == 4 and isinstance(args[2], tuple):
            name, args = getattr(args[0], "name", ""), args[2]
        index = {"_rebuild_tensor_v2": 6, "_rebuild_tensor_v3": 7}.get(name)
        if index is None or len(args) <= index or not isinstance(args[index], dict):
            return frozenset()
        return frozenset(k for k in args[index] if k in ("conj", "neg"))

    @property
    def byte_offset(self) -> int:
        """Offset of the first element inside the storage, in bytes."""
        return self.offset * itemsize(self.dtype)

    @property
    def byte_span(self) -> tuple[int, int]:
        """``(first byte, end byte)`` of the storage bytes the elements lie in.

        Relative to the start of the storage's bytes (:attr:`StorageRef.root_span` for a
        legacy view). Strides are never negative (the readers refuse them), so the first
        element is the lowest address and the end is one element past the highest: the
        offset plus ``(size - 1) * stride`` summed over the dimensions. A tensor without
        elements spans nothing, ``(first, first)``; a 0-d tensor spans one element, and a
        zero stride (an expanded view) revisits the same bytes, so the span can be shorter
        than :attr:`nbytes`.

        Example:
            >>> s = StorageRef("0", "float32", 20, "cpu")
            >>> TensorRef(s, offset=2, shape=(3, 4), stride=(1, 3), dtype="float32").byte_span
            (8, 56)
        """
        first = self.byte_offset
        if self.numel == 0:
            return first, first
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return first, (last + 1) * itemsize(self.dtype)

    def is_contiguous(self) -> bool:
        """True when the elements are laid out densely in row-major order (as torch says).

        A tensor without elements is contiguous whatever its strides.
        """
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def covers_storage(self) -> bool:
        """True when the tensor is contiguous and spans its whole storage."""
        return self.offset == 0 and self.is_contiguous() and self.nbytes == self.storage.nbytes


@dataclass(frozen=True, eq=False)
class Reduced(Sealed):
    """The recorded call of an allowlisted global whose result we do not interpret.

    (``torch.device('cuda', 1)``, ``torch.serialization._get_layout``, sparse rebuilds.)
    """

    func: GlobalRef
    args: tuple[Any, ...]

    def __repr__(self) -> str:
        shown = [short_repr(a, 60) for a in self.args[:8]] + ["..."] * (len(self.args) > 8)
        return f"{self.func.qualname}({', '.join(shown)})"


@dataclass(frozen=True, eq=False, repr=False)
class RebuiltTensor(Reduced):
    """A tensor torch rebuilds by a call, not as a view of one storage: a sparse tensor (its
    indices and values are :class:`TensorRef` s in ``args``), a meta tensor (no bytes at all),
    or a nested tensor (a buffer viewed through sizes, strides and offsets tensors).

    Attributes:
        shape: sizes as torch reports them; a nested tensor's are its component count, then
            -1 for each of its components' dimensions (they lie in its sizes tensor).
        dtype: element type.
        layout: torch's layout name (``sparse_coo``, ``sparse_csr`` ...; ``strided`` for a
            meta tensor; ``nested`` for a nested one).
        device: ``meta``, or the device its parts were saved on.
        stride: a meta tensor's strides; empty for the others (torch has none for them).
        numel: its elements as ``numel()`` counts them (a nested tensor: its buffer's).
        parts: the tensors it is built from, whose storages hold its bytes.
    """

    shape: tuple[int, ...]
    dtype: str
    layout: str
    device: str
    stride: tuple[int, ...]
    numel: int
    parts: tuple[TensorRef, ...]

    @property
    def nbytes(self) -> int:
        """The bytes of its parts' elements: what the file holds for it."""
        return sum(part.nbytes for part in self.parts)


class Opaque:
    """Stand-in for an object of a class outside the allowlist; the class is never imported.

    The unpickler makes one subclass per global (so ``type(obj).global_ref`` names it) and
    records everything the pickle did to the object, so it can be re-emitted faithfully.
    """

    global_ref: GlobalRef = GlobalRef("builtins", "object")

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        # The NEWOBJ opcode calls only cls.__new__(cls, *args); REDUCE calls cls(*args),
        # which then runs __init__ and marks the object as made by a call.
        obj = super().__new__(cls)
        obj.args = args
        obj.newobj = True
        obj.state = None
        obj.has_state = False
        obj.listitems = []
        obj.dictitems = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.newobj = False

    def __setstate__(self, state: Any) -> None:
        self.state = state
        self.has_state = True

    def __setitem__(self, key: Any, value: Any) -> None:
        self.dictitems.append((key, value))

    def append(self, value: Any) -> None:
        self.listitems.append(value)

    def extend(self, values: Any) -> None:
        self.listitems.extend(values)

    def __repr__(self) -> str:
        return f"<{self.global_ref.qualname} (not imported)>"
