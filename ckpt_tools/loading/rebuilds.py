"""torch's own calls for what the reader describes beyond one storage's view, made as
``torch.load(weights_only=True)`` makes them from the built arguments: sparse, meta and
nested tensors, and the ``_DimRange`` objects a jagged nested tensor's metadata holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ckpt_tools.formats.pickle.rebuilt import check_nested_parts
from ckpt_tools.formats.pickle.standins import DimRange

__all__ = ["DEVICE_TENSOR", "TENSOR_CALLS", "dim_range"]


def _meta_tensor(dtype: Any, size: Any, stride: Any, requires_grad: Any) -> torch.Tensor:
    tensor = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    tensor.requires_grad = requires_grad
    return tensor


def _nested_tensor(*args: Any) -> torch.Tensor:
    # torch's rebuild views a buffer through sizes, strides and offsets it does not check
    # against the buffer: a component past its end is refused (a ValueError) before it.
    buffer, sizes, strides, offsets = args
    if not all(isinstance(a, torch.Tensor) and a.layout == torch.strided for a in args):
        raise TypeError("its buffer, sizes, strides and offsets must be tensors")
    check_nested_parts(buffer, sizes, strides, offsets)
    return torch._utils._rebuild_nested_tensor(buffer, sizes, strides, offsets)


DEVICE_TENSOR = "torch._utils._rebuild_device_tensor_from_cpu_tensor"
# The rebuilds of tensors that are not one storage's view, called as torch.load calls them.
TENSOR_CALLS: dict[str, Callable[..., torch.Tensor]] = {
    "torch._utils._rebuild_sparse_tensor": lambda *a: torch._utils._rebuild_sparse_tensor(*a),
    "torch._utils._rebuild_meta_tensor_no_storage": _meta_tensor,
    "torch._utils._rebuild_nested_tensor": _nested_tensor,
}


def dim_range(node: DimRange) -> Any:
    """The ``torch._dynamo.decorators._DimRange`` that ``node`` stands for.

    torch.load makes it with ``__new__``, then sets its fields from the BUILD state; one
    whose state was never set keeps its slots empty, as there.
    """
    # Imported here, not with torch: torch._dynamo is a heavy import, and only files holding
    # a jagged tensor's dynamic ranges need it (torch.load needs it imported for them too).
    from torch._dynamo.decorators import _DimRange

    if node.values is None:
        return _DimRange.__new__(_DimRange)
    return _DimRange(*node.values)
