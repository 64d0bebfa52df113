"""numpy values in a pickle read as data: arrays as tensor bytes, scalars as numbers.

``sanitize`` turns what numpy pickled (``numpy.core.multiarray._reconstruct`` with an
``ndarray`` state, protocol 5's ``_frombuffer``, ``scalar`` with a dtype and bytes) into plain
values, from the recorded
arguments alone: numpy is never asked to unpickle anything.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

from ckpt_tools.descriptors import Opaque
from ckpt_tools.dtypes import itemsize

__all__ = [
    "NUMPY_FROMBUFFER",
    "NUMPY_MODULES",
    "NdarrayParts",
    "empty_bytes",
    "ndarray_parts",
    "numpy_scalar",
]

#: The modules numpy pickles arrays and scalars through (numpy 1 and numpy 2).
NUMPY_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")
#: The function protocol 5 pickles a contiguous array through (numpy 1 and numpy 2).
NUMPY_FROMBUFFER = ("numpy.core.numeric._frombuffer", "numpy._core.numeric._frombuffer")
# numpy's dtype codes -> (torch dtype, struct format of one element).
_NUMPY_DTYPES: dict[str, tuple[str, str]] = {
    "b1": ("bool", "?"),
    "i1": ("int8", "b"),
    "u1": ("uint8", "B"),
    "i2": ("int16", "h"),
    "u2": ("uint16", "H"),
    "i4": ("int32", "i"),
    "u4": ("uint32", "I"),
    "i8": ("int64", "q"),
    "u8": ("uint64", "Q"),
    "f2": ("float16", "e"),
    "f4": ("float32", "f"),
    "f8": ("float64", "d"),
    "c8": ("complex64", "ff"),
    "c16": ("complex128", "dd"),
}


class NdarrayParts(NamedTuple):
    """A pickled ``numpy.ndarray`` as a tensor: its dtype, shape, strides and bytes
    (little-endian, row-major or column-major as saved)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data: bytes


def ndarray_parts(node: Opaque) -> NdarrayParts | None:
    """The tensor a pickled plain ``numpy.ndarray`` holds; None for anything else (object,
    structured or unknown dtypes, inconsistent sizes).

    Protocol 5 pickles a contiguous array as ``_frombuffer(buffer, dtype, shape, order)``;
    earlier protocols as ``_reconstruct`` with an ``ndarray`` state.
    """
    if type(node).global_ref.qualname in NUMPY_FROMBUFFER:
        return _from_buffer(node)
    state = node.state
    cls = node.args[0] if node.args else None
    if not (
        isinstance(cls, type)
        and issubclass(cls, Opaque)
        and cls.global_ref.qualname in ("numpy.ndarray", "numpy.core.ndarray")
        and isinstance(state, tuple)
        and len(state) == 5
        and isinstance(state[1], tuple)
        and all(isinstance(n, int) and n >= 0 for n in state[1])
    ):
        return None
    _, shape, dtype, fortran, raw = state
    return _parts(raw, dtype, tuple(shape), bool(fortran))


def _from_buffer(node: Opaque) -> NdarrayParts | None:
    """``numpy.frombuffer(buffer, dtype).reshape(shape, order=order)``, as numpy's
    ``_frombuffer`` builds it; a dense array in neither order (a transposed one) is saved
    row-major with ``order="K"`` and the ``axis_order`` that transposes it back."""
    if len(node.args) not in (4, 5) or node.has_state:
        return None
    raw, dtype, shape, order, *axes = node.args
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return None
    axis_order = axes[0] if axes and order == "K" else None
    if axis_order is not None:
        if not (isinstance(axis_order, (tuple, list)) and _is_permutation(axis_order, shape)):
            return None
        parts = _parts(raw, dtype, shape, fortran=False)
        if parts is None:
            return None
        return parts._replace(
            shape=tuple(shape[a] for a in axis_order),
            stride=tuple(parts.stride[a] for a in axis_order),
        )
    if order not in ("C", "F"):
        return None
    return _parts(raw, dtype, shape, order == "F")


def _is_permutation(axes: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``axes`` orders every dimension of ``shape`` once, as ``transpose`` takes."""
    return all(type(a) is int for a in axes) and sorted(axes) == list(range(len(shape)))


def _parts(raw: Any, dtype: Any, shape: tuple[int, ...], fortran: bool) -> NdarrayParts | None:
    raw = b"" if empty_bytes(raw) else raw
    spec = _dtype(dtype)
    if spec is None or not isinstance(raw, (bytes, bytearray)):
        return None
    torch_dtype, fmt, order = spec
    size = itemsize(torch_dtype)
    if len(raw) != math.prod(shape) * size:
        return None
    data = bytes(raw) if order == "<" else _to_little(raw, size // len(fmt))
    return NdarrayParts(torch_dtype, shape, _strides(shape, fortran), data)


def numpy_scalar(node: Opaque) -> tuple[str, Any] | None:
    """``(torch dtype, value)`` of a pickled numpy scalar; None for anything else."""
    spec = _dtype(node.args[0]) if len(node.args) == 2 else None
    raw = node.args[1] if spec is not None else None
    if spec is None or not isinstance(raw, bytes) or len(raw) != struct.calcsize(spec[1]):
        return None
    torch_dtype, fmt, order = spec
    parts = struct.unpack(order + fmt, raw)
    return torch_dtype, complex(*parts) if len(parts) == 2 else parts[0]


def _dtype(dtype: Any) -> tuple[str, str, str] | None:
    """(torch dtype, struct format, byte order) of a pickled ``numpy.dtype``, if plain."""
    if not (
        isinstance(dtype, Opaque)
        and type(dtype).global_ref.qualname == "numpy.dtype"
        and dtype.args
    ):
        return None
    code, state = dtype.args[0], dtype.state
    if not isinstance(code, str) or code not in _NUMPY_DTYPES:
        return None
    if not (isinstance(state, tuple) and len(state) >= 5 and state[3] is None):
        return None  # structured dtypes (names) have no tensor equivalent
    order = ">" if state[1] == ">" else "<"
    return (*_NUMPY_DTYPES[code], order)


def empty_bytes(node: Any) -> bool:
    # Protocol 2 pickles b"" as a call of ``bytes`` with no arguments (not on the allowlist).
    return (
        isinstance(node, Opaque)
        and type(node).global_ref.qualname in ("builtins.bytes", "__builtin__.bytes")
        and node.args == ()
        and not node.has_state
    )


def _strides(shape: tuple[int, ...], fortran: bool) -> tuple[int, ...]:
    order = range(len(shape)) if fortran else reversed(range(len(shape)))
    strides = [0] * len(shape)
    step = 1
    for dim in order:
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


def _to_little(raw: bytes | bytearray, width: int) -> bytes:
    """Big-endian elements (complex: each part) as little-endian bytes."""
    import numpy as np  # only big-endian arrays need it; it never sees a foreign object

    return np.frombuffer(raw, dtype=np.dtype(f"u{width}")).byteswap().tobytes()
