"""Stand-ins for values an allowlisted pickle holds: dtypes, storage classes, sizes, recorded calls.

They are what :mod:`ckpt_tools.formats.pickle.allowlist` resolves globals to (and what its rebuild
functions return besides tensor descriptors); readers, the re-pickler and the loaders
recognise them. None imports the module a pickle names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import GlobalRef, Opaque, Reduced
from ckpt_tools.dtypes import DTYPE_STORAGE_TYPE, STORAGE_TYPE_DTYPE
from ckpt_tools.errors import CorruptCheckpointError

__all__ = [
    "DIM_RANGE",
    "MESH_LAYOUT_CLASSES",
    "UNTYPED_STORAGE",
    "ConstantRef",
    "DimRange",
    "Reduced",
    "StorageTypeRef",
    "TorchSize",
    "id_text",
    "is_count",
    "module_record",
    "storage_location",
    "storage_type_ref",
]

# Sizes, strides, offsets and element counts are int64 in torch.
_INT64_LIMIT = 1 << 63


def is_count(value: Any) -> bool:
    """A size, stride, offset or element count torch takes: an int in ``[0, 2**63)``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _INT64_LIMIT


@dataclass(frozen=True)
class ConstantRef(GlobalRef):
    """An allowlisted global used as a value (``torch.float32``, ``torch.Tensor``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Saying which global was called beats Python's bare TypeError. torch refuses calls
        # of dtypes, layouts and storage types; it does call the tensor classes (an empty
        # tensor), which this reader builds only through torch's rebuild functions.
        if self.name.endswith("Tensor") or self.name == "Parameter":
            raise CorruptCheckpointError(
                f"the pickle calls {self.qualname} to build a tensor; tensors are read only "
                "when built by torch._utils' rebuild functions, as torch.save writes them"
            )
        raise CorruptCheckpointError(
            f"the pickle calls {self.qualname}, a value that cannot be called; "
            "torch refuses the file too"
        )


@dataclass(frozen=True)
class StorageTypeRef(ConstantRef):
    """A storage class global (``torch.FloatStorage``) with the dtype it stands for."""

    @property
    def dtype(self) -> str:
        return STORAGE_TYPE_DTYPE[self.name]


# torch.save names it ``torch.storage.UntypedStorage``; torch.load(weights_only=True) refuses
# ``torch.UntypedStorage``.
UNTYPED_STORAGE = StorageTypeRef("torch.storage", "UntypedStorage")


class TorchSize(tuple):
    """``torch.Size`` read from a pickle: a tuple that re-pickles as ``torch.Size``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.Size({short_repr(list(self), 200)})"


def storage_type_ref(dtype: str) -> StorageTypeRef:
    """The storage class ``torch.save`` names for a storage of ``dtype``.

    The typed class where there is one (``torch.FloatStorage``), else
    ``torch.storage.UntypedStorage``, whose elements are bytes.

    Example:
        >>> storage_type_ref("float32").qualname
        'torch.FloatStorage'
    """
    name = DTYPE_STORAGE_TYPE.get(dtype)
    return StorageTypeRef("torch", name) if name is not None else UNTYPED_STORAGE


def module_record(record: tuple[Any, ...]) -> Any:
    """The class a legacy file's module record ``(class, source file, source)`` stands for.

    torch's legacy readers call ``_check_container_source(*record)`` when the last two are
    set, which takes exactly three values and needs a class (any other record fails there,
    as in a fuzzed file holding ``("5",)``), and return the first. We take the shape
    ``torch.save`` wrote and refuse the rest.

    Raises:
        CorruptCheckpointError: any other record.
    """
    if (
        len(record) == 3
        and isinstance(record[0], type)
        and all(isinstance(value, str | None) for value in record[1:])
    ):
        return record[0]
    raise CorruptCheckpointError(
        f"unexpected module record {short_repr(record)} (torch's reader takes a class, its "
        "source file and its source)"
    )


def storage_location(value: Any) -> str | None:
    """A storage id's device tag as torch reads it: text, or ASCII bytes (Python 2 files).

    torch hands the tag to ``re.match`` (or to ``map_location``): an int there fails with a
    TypeError under the default ``map_location``, so it is refused, not turned into text.
    """
    if isinstance(value, bytes):
        return value.decode("ascii") if value.isascii() else None
    return value if isinstance(value, str) else None


def id_text(value: Any) -> str | None:
    """A storage key or location tag as text (ints and Python 2 bytes too); None otherwise.

    The one reading of the keys and tags in storage ids, in the legacy format's key list and
    in the tar format's headers.

    Example:
        >>> id_text(b"cuda:1"), id_text(7), id_text(None)
        ('cuda:1', '7', None)
    """
    if isinstance(value, bytes):
        return value.decode("ascii", "replace")
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and is_count(value):
        return str(value)
    return None


# The device-mesh layout classes ``import torch`` puts on torch's weights-only allowlist
# (torch.distributed._mesh_layout registers them with add_safe_globals; a DeviceMesh pickles
# its layout). They stand in as Opaque objects that record what the pickle did, so rewrites
# re-emit them, but they are allowlisted: never reported as unsafe, refused only where
# torch's own calls fail.
class _LayoutObject(Opaque):
    """An object of an allowlisted mesh layout class, never imported."""

    # How many positional arguments the class's __init__ takes (a REDUCE calls it).
    arity: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # NEWOBJ calls only __new__, which torch's object.__new__ lets take any arguments
        # (the class defines __init__); REDUCE calls the dataclass __init__, which does not.
        if len(args) != self.arity or kwargs:
            raise CorruptCheckpointError(
                f"the pickle calls {self.global_ref.qualname} with {len(args)} arguments; it "
                f"takes {self.arity}, so torch.load fails on this call too"
            )
        if self.arity == 1 and isinstance(args[0], (int, float, complex, type(None))):
            # _MeshLayout(axes) takes tuple(axes).
            raise CorruptCheckpointError(
                f"the pickle calls {self.global_ref.qualname} with {short_repr(args[0], 40)}, "
                "which is not iterable; torch.load fails on it too"
            )
        super().__init__(*args, **kwargs)

    def __setstate__(self, state: Any) -> None:
        # The classes have no __setstate__: torch's BUILD updates __dict__ with the state,
        # or with its first half when it is a (dict state, slot state) pair.
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state, None)
        if not all(not p or isinstance(p, Mapping) for p in parts):
            raise CorruptCheckpointError(
                f"the pickle sets the state of a {self.global_ref.qualname} to "
                f"{short_repr(state, 40)}, not a dict; torch.load fails on it too"
            )
        super().__setstate__(state)


def _layout_class(name: str, arity: int) -> type[_LayoutObject]:
    ref = GlobalRef("torch.distributed._mesh_layout", name)
    return type(name, (_LayoutObject,), {"global_ref": ref, "arity": arity})


# One class per global, made once, so every GLOBAL naming it resolves to the same class.
MESH_LAYOUT_CLASSES: dict[str, type[_LayoutObject]] = {
    cls.global_ref.qualname: cls
    for cls in (_layout_class("_FlatLayout", 2), _layout_class("_MeshLayout", 1))
}


DIM_RANGE = GlobalRef("torch._dynamo.decorators", "_DimRange")


def _range_values(values: Any, how: str) -> tuple[int | None, int | None, int | None]:
    # torch's dataclass takes any three values; torch.save writes an int dimension and int
    # or None bounds (mark_dynamic's), and anything else is refused, never guessed at.
    if (
        isinstance(values, (list, tuple))
        and len(values) == 3
        and type(values[0]) is int
        and all(v is None or type(v) is int for v in values[1:])
    ):
        return (values[0], values[1], values[2])
    raise CorruptCheckpointError(
        f"the pickle {how} a {DIM_RANGE.qualname} with {short_repr(values, 60)}, not "
        "(dim, min, max) as torch.save writes it (an int, then ints or None)"
    )


class DimRange:
    """A ``torch._dynamo.decorators._DimRange`` read from a pickle: ``(dim, min, max)``.

    A jagged nested tensor made by ``torch.nested.nested_tensor`` marks its cached sequence
    lengths dynamic, which puts one of these per marked dimension in their
    ``_dynamo_dynamic_range`` set. torch.save pickles the frozen slots dataclass as NEWOBJ of
    the class (no arguments), then BUILD with the list its ``__getstate__`` gives, which its
    ``__setstate__`` zips with the fields. Never imported; equal and hashed as the dataclass.
    """

    __slots__ = ("values",)
    global_ref: ClassVar[GlobalRef] = DIM_RANGE

    def __new__(cls, *args: Any) -> DimRange:
        # NEWOBJ calls only __new__ (object.__new__, which ignores arguments for a class with
        # its own __init__); REDUCE calls the class, and its __init__ takes the three values.
        if args:
            _range_values(args, "builds")
        obj = super().__new__(cls)
        obj.values = None
        return obj

    def __init__(self, *args: Any) -> None:
        self.values = _range_values(args, "calls")

    def __setstate__(self, state: Any) -> None:
        self.values = _range_values(state, "sets the state of")

    def _fields(self) -> tuple[int | None, int | None, int | None]:
        if self.values is None:  # its slots were never set: the dataclass has no fields
            raise CorruptCheckpointError(
                f"the pickle compares or hashes a {DIM_RANGE.qualname} whose fields were "
                "never set; torch.load fails on it too"
            )
        return self.values

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DimRange):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        if self.values is None:
            return f"{DIM_RANGE.qualname}(<unset>)"
        dim, low, high = self.values
        return f"{DIM_RANGE.qualname}(dim={dim}, min={low}, max={high})"
