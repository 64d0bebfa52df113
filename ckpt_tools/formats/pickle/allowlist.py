"""The allowlist: what each permitted global of a checkpoint's pickle turns into.

Globals on the list (in the spirit of torch's ``weights_only`` unpickler) resolve to callers
that build descriptors of :mod:`ckpt_tools.descriptors` (tensors, storages) and check them,
or to the value stand-ins of :mod:`ckpt_tools.formats.pickle.standins`; safe Python containers are
real. Nothing here imports the module a
pickle names. :func:`resolve_allowed` is the one entry point the unpickler uses.
"""

from __future__ import annotations

import codecs
import collections
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import GlobalRef, RebuiltTensor, StorageRef, TensorRef
from ckpt_tools.dtypes import DTYPE_ITEMSIZE, STORAGE_TYPE_DTYPE, itemsize
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.pickle.jagged import JAGGED_GLOBALS, jagged_from_type, jagged_tensor
from ckpt_tools.formats.pickle.limits import numel_overflows
from ckpt_tools.formats.pickle.rebuilt import device_tensor, rebuilt_tensor
from ckpt_tools.formats.pickle.standins import (
    DIM_RANGE,
    MESH_LAYOUT_CLASSES,
    UNTYPED_STORAGE,
    ConstantRef,
    DimRange,
    Reduced,
    StorageTypeRef,
    TorchSize,
    is_count,
)
from ckpt_tools.formats.pickle.torch_calls import (
    check_device,
    check_layout,
    check_view_metadata,
    checked_size,
)

__all__ = ["ALLOWED_GLOBALS", "checked_tensor", "resolve_allowed"]


@dataclass(frozen=True)
class _Caller(GlobalRef):
    """An allowlisted callable global; calling it (REDUCE) builds a descriptor."""

    build: Callable[..., Any] | None = None
    min_args: int = 0
    max_args: int = 0

    def __call__(self, *args: Any) -> Any:
        assert self.build is not None
        if not self.min_args <= len(args) <= self.max_args:
            takes = (
                f"{self.min_args}"
                if self.min_args == self.max_args
                else f"{self.min_args} to {self.max_args}"
            )
            raise CorruptCheckpointError(
                f"the pickle calls {self.qualname} with {len(args)} positional arguments; "
                f"it takes {takes}, so torch.load fails on this call too"
            )
        return self.build(self, *args)


def _storage_dtype(storage: Any) -> str:
    if not isinstance(storage, StorageRef):
        raise CorruptCheckpointError(
            f"expected a tensor storage as the first rebuild argument, found {type(storage)!r}"
        )
    return storage.dtype


# The quantized dtypes that pack several values into each byte, and how many.
_PACKED = {"quint4x2": 2, "quint2x4": 4}


def checked_tensor(
    func: GlobalRef, args: tuple[Any, ...], storage: StorageRef, dtype: str, requires_grad: Any
) -> TensorRef:
    offset, size, stride = args[1], args[2], args[3]
    if not (
        isinstance(size, (tuple, list))
        and isinstance(stride, (tuple, list))
        and len(size) == len(stride)
        and all(is_count(v) for v in (offset, *size, *stride))
    ):
        raise CorruptCheckpointError(
            f"tensor geometry is invalid: offset={short_repr(offset)} size={short_repr(size)} "
            f"stride={short_repr(stride)}"
        )
    if numel_overflows(size):
        raise CorruptCheckpointError(
            f"tensor size {short_repr(list(size))} has more elements than torch counts (its "
            "product overflows 64 bits); torch.load fails on it too"
        )
    if dtype not in DTYPE_ITEMSIZE:
        raise CorruptCheckpointError(f"unknown tensor dtype {dtype!r}")
    if dtype in _PACKED:
        # Its storage holds several values per byte: every span here counts whole bytes.
        raise UnsupportedFormatError(
            f"a {dtype} tensor packs {_PACKED[dtype]} values in each byte of its storage, which "
            "ckpt_tools does not read; torch.load(weights_only=True) loads it"
        )
    tensor = TensorRef(
        storage=storage,
        offset=offset,
        shape=tuple(size),
        stride=tuple(stride),
        dtype=dtype,
        requires_grad=bool(requires_grad),
        func=GlobalRef(func.module, func.name),
        args=args,
    )
    # A legacy storage view's tensors index into the view, not into its root storage.
    first, end = storage.root_span
    capacity = (end - first) // itemsize(dtype)
    if tensor.numel:
        last = tensor.byte_span[1] // itemsize(dtype) - 1
        if last >= capacity:
            raise CorruptCheckpointError(
                f"tensor of shape {list(size)} at offset {offset} reaches element {last}, "
                f"but its storage {storage.key!r} holds {capacity} elements"
            )
    return tensor


def _flag(func: GlobalRef, value: Any) -> bool:
    # torch sets ``tensor.requires_grad = value``, which refuses anything but a bool.
    if not isinstance(value, bool):
        raise CorruptCheckpointError(
            f"the pickle calls {func.qualname} with requires_grad={short_repr(value, 40)}; "
            "torch.load fails on it too (requires_grad must be a bool)"
        )
    return value


def _rebuild_tensor(func: GlobalRef, *args: Any) -> TensorRef:
    # _rebuild_tensor(storage, offset, size, stride): torch < 1.0
    # _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])
    # _rebuild_qtensor(storage, offset, size, stride, qparams, requires_grad, hooks)
    if len(args) < 4:
        raise CorruptCheckpointError(f"{func.qualname} called with {len(args)} arguments")
    where = {"_rebuild_tensor_v2": 4, "_rebuild_qtensor": 5}.get(func.name)
    requires_grad = False if where is None else _flag(func, args[where])
    dtype = _storage_dtype(args[0])
    if func.name == "_rebuild_tensor_v2" and len(args) > 6:
        check_view_metadata(func.qualname, args[6], dtype)
    return checked_tensor(func, args, args[0], dtype, requires_grad)


def _rebuild_tensor_v3(func: GlobalRef, *args: Any) -> TensorRef:
    # (storage, offset, size, stride, requires_grad, hooks, dtype[, metadata]); untyped storage
    if len(args) < 7 or not isinstance(args[6], ConstantRef):
        raise CorruptCheckpointError(f"{func.qualname} called with unexpected arguments")
    dtype = args[6].name
    _storage_dtype(args[0])
    if len(args) > 7:
        check_view_metadata(func.qualname, args[7], dtype)
    return checked_tensor(func, args, args[0], dtype, _flag(func, args[4]))


def _rebuild_parameter(func: GlobalRef, *args: Any) -> TensorRef:
    # (data, requires_grad, hooks[, state])
    inner = args[0] if args else None
    if not isinstance(inner, TensorRef):
        raise CorruptCheckpointError(f"{func.qualname} expects a tensor, found {type(inner)!r}")
    return replace(
        inner,
        requires_grad=_flag(func, args[1]),
        is_parameter=True,
        func=GlobalRef(func.module, func.name),
        args=args,
    )


def _rebuild_from_type_v2(func: GlobalRef, *args: Any) -> Any:
    # (inner_func, new_type, inner_args, state): a Tensor subclass or a tensor with attributes
    if len(args) != 4 or not callable(args[0]) or not isinstance(args[2], tuple):
        raise CorruptCheckpointError(f"{func.qualname} called with unexpected arguments")
    inner = args[0](*args[2])
    if isinstance(inner, RebuiltTensor) and inner.layout == "jagged":
        return jagged_from_type(func, args, inner)
    if not isinstance(inner, TensorRef):
        return Reduced(GlobalRef(func.module, func.name), args)
    new_type = args[1]
    return replace(
        inner,
        is_parameter=inner.is_parameter
        or (isinstance(new_type, GlobalRef) and new_type.name == "Parameter"),
        func=GlobalRef(func.module, func.name),
        args=args,
    )


def _jagged(func: GlobalRef, *args: Any) -> RebuiltTensor:
    # _rebuild_njt(constructor_kwargs): a jagged nested tensor
    return jagged_tensor(func, args[0])


def _reduced(func: GlobalRef, *args: Any) -> Reduced:
    return Reduced(GlobalRef(func.module, func.name), args)


def _size(func: GlobalRef, *args: Any) -> TorchSize:
    return TorchSize(checked_size(args[0] if args else ()))


def _device(func: GlobalRef, *args: Any) -> Reduced:
    check_device(args)
    return _reduced(func, *args)


def _layout(func: GlobalRef, *args: Any) -> Reduced:
    check_layout(args[0] if args else None)
    return _reduced(func, *args)


def _sparse(func: GlobalRef, *args: Any) -> Reduced:
    # _rebuild_sparse_tensor(layout, data): a layout is pickled as _get_layout("torch.x").
    layout = args[0] if args else None
    name = layout.args[0] if isinstance(layout, Reduced) and layout.args else None
    if isinstance(layout, ConstantRef):
        name = layout.qualname
    check_layout(name, sparse=True, shown=layout)
    return rebuilt_tensor(func, args)


def _rebuilt(func: GlobalRef, *args: Any) -> Reduced:
    # Meta and nested tensors: described for inspect, built by torch's rebuild when loaded.
    return rebuilt_tensor(func, args)


def _device_tensor(func: GlobalRef, *args: Any) -> Reduced:
    return device_tensor(func, args)


# The codecs Python's pickler names in ``_codecs.encode(text, "latin1")`` (bytes and
# bytearray at protocols 0-2), plus the default. Any other name would make the codec registry
# import a module (``rot13`` imports ``encodings.rot_13``, ``idna`` imports ``stringprep``).
_PICKLE_CODECS = frozenset({"latin1", "latin-1", "latin_1", "iso-8859-1", "utf-8", "utf8"})


def _codecs_encode(func: GlobalRef, *args: Any) -> bytes:
    # encode(obj, encoding="utf-8", errors="strict")
    defaults = (None, "utf-8", "strict")
    text, encoding, errors = (*args, *defaults[len(args) :]) if len(args) <= 3 else defaults
    if (
        not isinstance(text, str)
        or not isinstance(encoding, str)
        or encoding.lower() not in _PICKLE_CODECS
        or errors != "strict"
    ):
        shown = ", ".join(short_repr(a, 40) for a in args[1:])
        raise CorruptCheckpointError(
            f"the pickle calls _codecs.encode with ({shown}); pickles only ever encode text "
            "with 'latin1', so this codec is refused (it is never looked up)"
        )
    return codecs.encode(text, encoding)


def _unrepresentable(func: GlobalRef, *args: Any) -> Any:
    # torch.save names storage classes only inside storage ids; a pickle that calls one
    # builds a storage torch may or may not accept, and none that a descriptor can stand for.
    raise CorruptCheckpointError(
        f"the pickle calls {func.qualname} itself ({len(args)} arguments); torch.save never "
        "writes that, and a storage built so cannot be read as a checkpoint's tensor data"
    )


def _counter(func: GlobalRef, *args: Any) -> collections.Counter[Any]:
    return collections.Counter(*args)


# Each callable global: its stand-in, and how many positional arguments the real function
# accepts (min, max), as its signature in torch 2.13 (torch/_utils.py) has it. A REDUCE with
# any other count is refused, as the real call fails there (TypeError) and torch.load with it.
_BUILDERS: dict[str, tuple[Callable[..., Any], int, int]] = {
    "torch._utils._rebuild_tensor": (_rebuild_tensor, 4, 4),
    "torch._utils._rebuild_tensor_v2": (_rebuild_tensor, 6, 7),
    "torch._utils._rebuild_qtensor": (_rebuild_tensor, 7, 7),
    "torch._utils._rebuild_tensor_v3": (_rebuild_tensor_v3, 7, 8),
    "torch._utils._rebuild_parameter": (_rebuild_parameter, 3, 3),
    "torch._utils._rebuild_parameter_with_state": (_rebuild_parameter, 4, 4),
    "torch._tensor._rebuild_from_type_v2": (_rebuild_from_type_v2, 4, 4),
    "torch.Size": (_size, 0, 1),
    "torch.device": (_device, 1, 2),
    "torch.serialization._get_layout": (_layout, 1, 1),
    "torch._utils._rebuild_sparse_tensor": (_sparse, 2, 2),
    "torch._utils._rebuild_nested_tensor": (_rebuilt, 4, 4),
    "torch._utils._rebuild_meta_tensor_no_storage": (_rebuilt, 4, 4),
    JAGGED_GLOBALS[0]: (_jagged, 1, 1),
    "torch._utils._rebuild_wrapper_subclass": (_reduced, 8, 8),
    "torch._utils._rebuild_device_tensor_from_numpy": (_reduced, 4, 4),
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": (_device_tensor, 4, 4),
    "collections.Counter": (_counter, 0, 1),
    "_codecs.encode": (_codecs_encode, 1, 3),
    "torch.storage.TypedStorage": (_unrepresentable, 0, 1 << 62),
}

# Python types that are safe to use for real (exactly those torch admits). They are built-in
# (immutable) types: a pickle's BUILD opcode on the class itself cannot set attributes on
# them. Pure-Python classes (``collections.Counter``) and functions go through _Caller
# stand-ins instead, which are sealed against BUILD, so a pickle can never patch a class of
# this process.
_PYTHON_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": collections.OrderedDict,
    "builtins.set": set,
    "builtins.bytearray": bytearray,
    "builtins.complex": complex,
}

_TORCH_CONSTANTS: frozenset[str] = frozenset(
    [f"torch.{d}" for d in DTYPE_ITEMSIZE]
    # Sub-byte integer dtypes: values only, no tensor of them is read (their dtype is unknown
    # to the rebuilds here), as torch has no storage of them to save.
    + [f"torch.{u}int{bits}" for u in ("", "u") for bits in range(1, 8)]
    + [
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.per_tensor_affine",
        "torch.per_tensor_symmetric",
        "torch.per_channel_affine",
        "torch.per_channel_symmetric",
        "torch.per_channel_affine_float_qparams",
    ]
    + [
        f"torch.{prefix}{kind}Tensor"
        for prefix in ("", "cuda.")
        for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte")
    ]
    + ["torch.BoolTensor", "torch.cuda.BoolTensor"]
    # The legacy sparse tensor classes (torch has no sparse BoolTensor).
    + [
        f"torch.{prefix}sparse.{kind}Tensor"
        for prefix in ("", "cuda.")
        for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte")
    ]
    + [JAGGED_GLOBALS[1]]
)


# The storage classes torch's weights-only unpickler admits: the typed ones under ``torch``,
# all but the quantized ones under ``torch.cuda``, and ``torch.storage.UntypedStorage``
# (``torch.UntypedStorage`` and ``torch.storage.FloatStorage`` are refused there).
_STORAGE_TYPES: frozenset[str] = frozenset(
    [f"torch.{n}" for n in STORAGE_TYPE_DTYPE if n != UNTYPED_STORAGE.name]
    + [
        f"torch.cuda.{n}"
        for n in STORAGE_TYPE_DTYPE
        if n != UNTYPED_STORAGE.name and not n.startswith("Q")
    ]
    + [UNTYPED_STORAGE.qualname]
)

# Every global the allowlist resolves: exactly torch's weights-only allowlist (torch 2.13) as
# ``import torch`` leaves it (torch.nested adds the jagged tensor's two, torch.distributed the
# mesh layouts), so a pickle torch refuses for a global is never read here as if it were safe,
# and one torch reads is never reported as unsafe. One more: ``_DimRange``, which
# ``import torch._dynamo`` adds, and which torch's refusal of a jagged tensor saved by
# ``torch.nested.nested_tensor`` tells its users to import. The DTensor classes that
# ``torch._dynamo`` imports and allowlists on the way are not taken: no NJT needs them.
ALLOWED_GLOBALS: frozenset[str] = frozenset(
    [
        *_PYTHON_GLOBALS,
        *_BUILDERS,
        *_STORAGE_TYPES,
        *_TORCH_CONSTANTS,
        *MESH_LAYOUT_CLASSES,
        DIM_RANGE.qualname,
    ]
)


def resolve_allowed(module: str, name: str) -> Any | None:
    """The stand-in for an allowlisted global, or None when ``module.name`` is not allowed."""
    qualname = f"{module}.{name}"
    if qualname in _PYTHON_GLOBALS:
        return _PYTHON_GLOBALS[qualname]
    if qualname in _BUILDERS:
        return _Caller(module, name, *_BUILDERS[qualname])
    if qualname in _STORAGE_TYPES:
        return StorageTypeRef(module, name)
    if qualname in _TORCH_CONSTANTS:
        return ConstantRef(module, name)
    if qualname == DIM_RANGE.qualname:
        return DimRange
    return MESH_LAYOUT_CLASSES.get(qualname)
