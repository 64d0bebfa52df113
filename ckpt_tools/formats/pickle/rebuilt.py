"""Tensors torch rebuilds by a call, not as one storage's view: sparse, meta and nested ones.

Each is described from its rebuild call's arguments (:class:`~ckpt_tools.descriptors.RebuiltTensor`:
shape, dtype, layout, device), so ``inspect`` lists it as a tensor without importing torch. A
call whose arguments do not have the shapes torch.save writes stays a plain recorded call;
the loader hands it to torch's own rebuild, which takes or refuses it as torch.load does.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from ckpt_tools.descriptors import GlobalRef, RebuiltTensor, Reduced, TensorRef
from ckpt_tools.dtypes import DTYPE_ITEMSIZE
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.pickle.standins import ConstantRef, TorchSize, is_count
from ckpt_tools.formats.pickle.torch_calls import check_device

__all__ = ["Array", "check_nested_parts", "device_tensor", "rebuilt_tensor"]


class Array(Protocol):
    """A torch tensor or a numpy array, as far as the bounds checks use one."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def tolist(self) -> Any: ...


def _parts(values: Any, count: int) -> tuple[TensorRef, ...] | None:
    """``values``' first ``count`` items when they are all tensor descriptors."""
    if not isinstance(values, tuple) or len(values) < count:
        return None
    parts = values[:count]
    return parts if all(isinstance(p, TensorRef) for p in parts) else None


def _sparse(layout: str, data: Any) -> dict[str, Any] | None:
    # COO: (indices, values, size[, is_coalesced]); compressed: (indices, indices, values, size)
    count = 2 if layout == "sparse_coo" else 3
    parts = _parts(data, count)
    size = data[count] if parts is not None and len(data) > count else None
    if parts is None or not isinstance(size, TorchSize):
        return None
    values = parts[-1]
    return {
        "shape": tuple(size),
        "dtype": values.dtype,
        "layout": layout,
        "device": values.device,
        "stride": (),
        "numel": math.prod(size),
        "parts": parts,
    }


def _meta(args: tuple[Any, ...]) -> dict[str, Any] | None:
    # (dtype, size, stride, requires_grad): no storage, no bytes
    dtype, size, stride, _ = args
    sizes = (size, stride)
    if not isinstance(dtype, ConstantRef) or dtype.name not in DTYPE_ITEMSIZE:
        return None
    if not all(isinstance(v, tuple) and all(is_count(n) for n in v) for v in sizes):
        return None
    if len(size) != len(stride):
        return None
    return {
        "shape": tuple(size),
        "dtype": dtype.name,
        "layout": "strided",
        "device": "meta",
        "stride": tuple(stride),
        "numel": math.prod(size),
        "parts": (),
    }


def _nested(args: tuple[Any, ...]) -> dict[str, Any] | None:
    # (buffer, sizes, strides, storage_offsets): sizes is (components, dimensions)
    parts = _parts(args, 4)
    if parts is None or len(parts[1].shape) != 2:
        return None
    buffer, sizes = parts[0], parts[1]
    return {
        "shape": (sizes.shape[0],) + (-1,) * sizes.shape[1],
        "dtype": buffer.dtype,
        "layout": "nested",
        "device": buffer.device,
        "stride": (),
        "numel": buffer.numel,
        "parts": parts,
    }


def check_nested_parts(buffer: Array, sizes: Array, strides: Array, offsets: Array) -> None:
    """Refuse a nested tensor's parts unless every component lies inside its buffer.

    torch's rebuild (``_nested_view_from_buffer``) views the buffer through the sizes,
    strides and offsets without checking them against it, so a component past its end would
    read memory outside the storage. Component ``i`` spans the elements from ``offsets[i]``
    to ``offsets[i] + sum((sizes[i][d] - 1) * strides[i][d])``; one with a zero size spans
    nothing. The loader and the value diff both check with this before torch sees the parts.

    Args:
        buffer: the flat buffer (its shape is all that is read).
        sizes: ``(components, dimensions)`` sizes.
        strides: strides of the same shape.
        offsets: ``(components,)`` offsets into the buffer, in elements.

    Raises:
        ValueError: the parts' shapes do not describe the same components, a size, stride or
            offset is negative, the buffer is not flat, or a component reaches past its last
            element.

    Example:
        >>> import numpy as np
        >>> check_nested_parts(np.zeros(6), np.array([[2, 3]]), np.array([[3, 1]]), np.array([1]))
        Traceback (most recent call last):
        ...
        ValueError: a component lies past the end of its 6-element buffer
    """
    if len(sizes.shape) != 2 or strides.shape != sizes.shape or offsets.shape != sizes.shape[:1]:
        raise ValueError("its sizes, strides and offsets do not describe the same components")
    rows = list(zip(sizes.tolist(), strides.tolist(), offsets.tolist()))
    if any(n < 0 for size, stride, offset in rows for n in (*size, *stride, offset)):
        raise ValueError("it has a negative size, stride or offset")
    if len(buffer.shape) != 1:
        raise ValueError(f"its buffer has {len(buffer.shape)} dimensions, not one")
    numel = buffer.shape[0]
    for size, stride, offset in rows:
        end = offset + sum((n - 1) * step for n, step in zip(size, stride))
        if 0 not in size and end >= numel:
            raise ValueError(f"a component lies past the end of its {numel}-element buffer")


def _layout_name(layout: Any) -> str | None:
    """``torch.sparse_csr`` pickled as ``_get_layout("torch.sparse_csr")``, or the global."""
    if isinstance(layout, ConstantRef):
        return layout.qualname.removeprefix("torch.")
    if isinstance(layout, Reduced) and layout.args and isinstance(layout.args[0], str):
        return layout.args[0].removeprefix("torch.")
    return None


def rebuilt_tensor(func: GlobalRef, args: tuple[Any, ...]) -> Reduced:
    """The recorded call ``func(*args)`` of a sparse, meta or nested rebuild, described.

    Args:
        func: ``torch._utils._rebuild_sparse_tensor``, ``_rebuild_meta_tensor_no_storage``
            or ``_rebuild_nested_tensor``.
        args: its arguments as unpickled (their count already checked).

    Returns:
        A :class:`RebuiltTensor`, or a plain :class:`Reduced` where the arguments are not
        what torch.save writes.

    Example:
        >>> meta = rebuilt_tensor(
        ...     GlobalRef("torch._utils", "_rebuild_meta_tensor_no_storage"),
        ...     (ConstantRef("torch", "float16"), TorchSize((2, 3)), TorchSize((3, 1)), False),
        ... )
        >>> meta.shape, meta.dtype, meta.device
        ((2, 3), 'float16', 'meta')
    """
    ref = GlobalRef(func.module, func.name)
    found: dict[str, Any] | None = None
    if func.name == "_rebuild_sparse_tensor":
        layout = _layout_name(args[0])
        found = _sparse(layout, args[1]) if layout is not None else None
    elif func.name == "_rebuild_meta_tensor_no_storage":
        found = _meta(args)
    elif func.name == "_rebuild_nested_tensor":
        found = _nested(args)
    return Reduced(ref, args) if found is None else RebuiltTensor(ref, args, **found)


def device_tensor(func: GlobalRef, args: tuple[Any, ...]) -> Reduced:
    """``_rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad)``, described.

    torch.save writes it for a tensor of a backend without storages (``xla``, ``maia``,
    ``mtia``): its CPU copy, rebuilt as a view, which torch then moves (and casts) with
    ``data.to(dtype=dtype, device=device)``. It is described as that copy with the dtype and
    device tag it gets: a :class:`RebuiltTensor` whose one part holds its bytes.

    Raises:
        CorruptCheckpointError: the dtype is no dtype, the device no device name, or
            ``requires_grad`` no bool (or true for an integer dtype): torch fails on those.

    Example:
        >>> device_tensor(GlobalRef("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"),
        ...               (None, ConstantRef("torch", "float32"), "xla:0", False))
        torch._utils._rebuild_device_tensor_from_cpu_tensor(None,
            ConstantRef(module='torch', name='float32'), 'xla:0', False)
    """
    data, dtype, device, requires_grad = args
    if not isinstance(dtype, ConstantRef) or dtype.name not in DTYPE_ITEMSIZE:
        raise CorruptCheckpointError(f"{func.qualname} called with dtype {dtype!r}")
    check_device((device,))
    floating = dtype.name.startswith(("float", "bfloat", "complex"))
    if not isinstance(requires_grad, bool) or (requires_grad and not floating):
        # torch sets tensor.requires_grad, which takes a bool, and True only where it can.
        raise CorruptCheckpointError(
            f"{func.qualname} called with requires_grad={requires_grad!r} for a "
            f"{dtype.name} tensor; torch.load fails on it too"
        )
    ref = GlobalRef(func.module, func.name)
    if not isinstance(data, TensorRef):
        # Not what torch.save writes: the recorded call, which the loader hands to nobody.
        return Reduced(ref, args)
    return RebuiltTensor(
        ref,
        args,
        shape=data.shape,
        dtype=dtype.name,
        layout="strided",
        device=device,
        stride=(),
        numel=data.numel,
        parts=(data,),
    )
