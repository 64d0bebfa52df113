"""Sparse, nested and meta tensors in a cast, made as torch's ``.to(dtype)`` makes them.

``.to(dtype)`` casts a sparse tensor's values and a nested tensor's buffer (a jagged one's
values); the indices (a nested tensor's sizes, strides and offsets, a jagged one's offsets,
lengths and cached sequence lengths) keep their dtype, and a COO tensor stays as coalesced as
it was. The values part's storage is cast as any other storage is
(:mod:`~ckpt_tools.ops.transform.cast_targets` decides which; each once), and the rebuild
call is written again with the cast part in its place. A meta tensor has no bytes: only its
dtype changes, when it is contiguous (torch keeps those strides; other strides it may
change, so such a meta tensor keeps its dtype, with a note).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import RebuiltTensor, StorageRef, TensorRef
from ckpt_tools.formats.pickle.jagged import jagged_arguments
from ckpt_tools.formats.pickle.standins import ConstantRef
from ckpt_tools.io.casting import CAST_SOURCES
from ckpt_tools.io.tensor_bytes import check_plain_values
from ckpt_tools.io.writers.saved_tensors import saved_tensor
from ckpt_tools.ops.transform.plan import DROPPED, Item
from ckpt_tools.structure.paths import key_text

__all__ = ["cast_rebuilt", "cast_rebuilt_items", "values_part"]


def values_part(t: RebuiltTensor) -> TensorRef | None:
    """The part holding ``t``'s values, the one a cast changes: a sparse tensor's values (its
    last part), a nested tensor's buffer (its first), a jagged one's ``values`` keyword; None
    for a meta tensor (no parts).

    Example:
        >>> from ckpt_tools.descriptors import GlobalRef
        >>> meta = GlobalRef("torch._utils", "_rebuild_meta_tensor_no_storage")
        >>> values_part(RebuiltTensor(meta, (), (2,), "float32", "strided", "meta", (1,), 2, ()))
    """
    if not t.parts:
        return None
    if t.layout == "jagged":
        return jagged_arguments(t)["values"]
    return t.parts[0] if t.layout == "nested" else t.parts[-1]


def cast_rebuilt(t: RebuiltTensor, values: TensorRef | None, dtype: str) -> RebuiltTensor:
    """``t`` as ``t.to(dtype)`` is pickled: its values part replaced by ``values`` (already
    cast, on its output storage), or for a meta tensor (``values`` None) its dtype.

    Args:
        t: the sparse, nested or meta tensor.
        values: the cast values part; None for a meta tensor.
        dtype: the dtype cast to.

    Returns:
        The output's tensor, with its rebuild call's arguments.
    """
    if values is None:  # meta: (dtype, size, stride, requires_grad)
        args: tuple[Any, ...] = (ConstantRef("torch", dtype), *t.args[1:])
        parts: tuple[TensorRef, ...] = ()
    else:
        old = values_part(t)
        args = _swapped(t.args, old, values)
        parts = tuple(values if p is old else p for p in t.parts)
    return RebuiltTensor(
        t.func,
        args,
        shape=t.shape,
        dtype=dtype,
        layout=t.layout,
        device=t.device,
        stride=t.stride,
        numel=t.numel,
        parts=parts,
    )


def _swapped(value: Any, old: Any, new: Any) -> Any:
    """``value`` with ``old`` replaced by ``new`` in its plain tuples and dicts (a sparse
    tensor's parts lie in a tuple inside the call's arguments; a jagged one's values in its
    constructor's keywords and again in its attribute state)."""
    if value is old:
        return new
    if type(value) is tuple:  # torch.Size and other tuple subclasses hold no tensors
        return tuple(_swapped(v, old, new) for v in value)
    if type(value) is dict:
        return {k: _swapped(v, old, new) for k, v in value.items()}
    return value


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def cast_rebuilt_items(
    items: Sequence[Item],
    out_storage: Mapping[int, StorageRef],
    targets: Mapping[int, str],
    cast_to: str | None,
    keep: Sequence[re.Pattern[str]],
    notes: list[str],
) -> dict[str, RebuiltTensor]:
    """The output's sparse, nested and meta tensors a cast changes, by output key.

    Args:
        items: ``(source key, output key or None, value)`` of the state dict.
        out_storage: ``id(source storage)`` -> its output storage.
        targets: the storages cast (``id`` -> source dtype), as ``cast_targets`` chose them.
        cast_to: the dtype cast to, or None (no cast).
        keep: keys matching any of these keep their dtype.
        notes: told of each meta tensor left uncast.

    Returns:
        Output key -> the tensor as cast; one whose values storage is not cast is absent.

    Raises:
        ConversionError: a values part saved as a conjugate or negative view.
    """
    cast: dict[str, RebuiltTensor] = {}
    if cast_to is None:
        return cast
    for old, new, value in items:
        if new is DROPPED or not isinstance(value, RebuiltTensor):
            continue
        part = values_part(value)
        if part is not None:
            if id(part.storage) in targets:
                check_plain_values(new, part, f"a cast to {cast_to}")
                done = saved_tensor(part, out_storage[id(part.storage)], cast_to)
                cast[new] = cast_rebuilt(value, done, cast_to)
            continue
        wanted = value.dtype in CAST_SOURCES and value.dtype != cast_to
        if not wanted or any(p.search(key_text(old)) for p in keep):
            continue
        if _contiguous(value.shape, value.stride):
            cast[new] = cast_rebuilt(value, None, cast_to)
        else:
            notes.append(
                f"meta tensor {new!r} kept as {value.dtype}: it is not contiguous, and torch's "
                ".to() may change its strides"
            )
    return cast
