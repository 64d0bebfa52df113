"""A tensor as ``torch.save`` pickles it: its storage's class and its rebuild call.

``torch.save`` names a typed storage class (``torch.FloatStorage``) for the dtypes that have
one and rebuilds the tensor with ``_rebuild_tensor_v2``. Every other dtype (float8, uint16,
uint32, uint64) is saved over an untyped storage of bytes and rebuilt with
``_rebuild_tensor_v3``, which takes the dtype. A Parameter is its data wrapped in
``_rebuild_parameter``. Every writer that makes a tensor a pickle did not hold builds it here.
"""

from __future__ import annotations

import collections
import math
from dataclasses import replace
from typing import Any

from ckpt_tools.descriptors import GlobalRef, StorageRef, TensorRef
from ckpt_tools.dtypes import DTYPE_STORAGE_TYPE, itemsize
from ckpt_tools.formats.pickle.standins import UNTYPED_STORAGE, ConstantRef, storage_type_ref

__all__ = ["fresh_tensor", "plain_tensor", "saved_storage", "saved_tensor"]

_V2 = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_V3 = GlobalRef("torch._utils", "_rebuild_tensor_v3")
_PARAMETER = GlobalRef("torch._utils", "_rebuild_parameter")


def saved_storage(like: StorageRef, dtype: str, numel: int | None = None) -> StorageRef:
    """A storage of ``numel`` elements of ``dtype``, with ``like``'s key and device, as
    ``torch.save`` names it: typed where ``dtype`` has a storage class, else bytes.

    Args:
        like: the storage whose key and device the new one takes.
        dtype: the dtype of the tensors on it.
        numel: its size in elements of ``dtype``; None: ``like``'s bytes (a storage read
            without a pickle, given the class torch.save names).

    Returns:
        The new storage (``id`` unique).

    Example:
        >>> s = StorageRef("0", "float32", 4, "cpu")
        >>> saved_storage(s, "bfloat16", 4).storage_type.qualname
        'torch.BFloat16Storage'
        >>> saved = saved_storage(s, "float8_e4m3fn", 4)
        >>> saved.dtype, saved.numel, saved.storage_type.qualname
        ('uint8', 4, 'torch.storage.UntypedStorage')
    """
    if numel is None:
        numel = like.nbytes // itemsize(dtype)
    if dtype in DTYPE_STORAGE_TYPE:
        return StorageRef(like.key, dtype, numel, like.device, storage_type_ref(dtype))
    return StorageRef(like.key, "uint8", numel * itemsize(dtype), like.device, UNTYPED_STORAGE)


def saved_tensor(like: TensorRef, storage: StorageRef, dtype: str) -> TensorRef:
    """``like``'s view (offset, shape, stride), grad flag and Parameter wrapper over
    ``storage`` as ``dtype``, with the rebuild call ``torch.save`` writes for it.

    Args:
        like: the tensor whose view and flags the new one takes.
        storage: the storage it lies on: an untyped one (bytes) is rebuilt with its dtype.
        dtype: its element type.

    Returns:
        The tensor descriptor, ready to pickle.

    Example:
        >>> s = StorageRef("0", "float32", 4, "cpu")
        >>> t = TensorRef(s, 1, (2,), (1,), "float32", True, True)
        >>> saved = saved_tensor(t, saved_storage(s, "uint16", 4), "uint16")
        >>> saved.func.name, saved.args[0].func.name, saved.args[0].args[-1].qualname
        ('_rebuild_parameter', '_rebuild_tensor_v3', 'torch.uint16')
    """
    view = (like.offset, like.shape, like.stride)
    untyped = storage.storage_type == UNTYPED_STORAGE
    func, extra = (_V3, (ConstantRef("torch", dtype),)) if untyped else (_V2, ())

    def rebuilt(requires_grad: bool) -> TensorRef:
        hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        args = (storage, *view, requires_grad, hooks, *extra)
        return TensorRef(storage, *view, dtype, requires_grad, False, func, args)

    if not like.is_parameter:
        return rebuilt(like.requires_grad)
    args = (rebuilt(False), like.requires_grad, collections.OrderedDict())
    return TensorRef(storage, *view, dtype, like.requires_grad, True, _PARAMETER, args)


def plain_tensor(t: TensorRef) -> TensorRef:
    """``t`` as the plain tensor ``torch.save`` writes for it (no subclass, no hooks): on
    its own storage where that already has torch's class for its dtype, so that it stays
    shared with the other tensors on it; else on a typed copy (a tensor read without a
    pickle).

    Example:
        >>> s = StorageRef("0", "float32", 4, "cpu", storage_type_ref("float32"))
        >>> plain_tensor(TensorRef(s, 0, (4,), (1,), "float32")).storage is s
        True
    """
    like, storage = replace(t, func=None, args=()), t.storage
    typed = storage.storage_type is not None and storage.dtype == t.dtype
    if typed or storage.storage_type == UNTYPED_STORAGE:
        return saved_tensor(like, storage, t.dtype)
    return saved_tensor(like, saved_storage(storage, t.dtype), t.dtype)


def fresh_tensor(t: TensorRef) -> TensorRef:
    """A contiguous tensor like ``t`` (shape, dtype, grad flag, parameter or not) over a new
    storage of its own, with the rebuild call torch.save writes for it.

    Args:
        t: the tensor to imitate.

    Returns:
        The new tensor; its storage is new (``id`` unique), with no record yet.

    Example:
        >>> s = StorageRef("0", "float32", 6, "cpu")
        >>> fresh_tensor(TensorRef(s, 4, (2,), (1,), "float32")).offset
        0
    """
    stride = tuple(math.prod(t.shape[i + 1 :]) for i in range(len(t.shape)))
    storage = saved_storage(t.storage, t.dtype, t.numel)
    return saved_tensor(replace(t, offset=0, stride=stride), storage, t.dtype)
