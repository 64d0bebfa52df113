"""Jagged nested tensors (NJTs: ``torch.nested.nested_tensor(..., layout=torch.jagged)``).

torch.save writes one as ``_rebuild_from_type_v2(_rebuild_njt, NestedTensor, (kwargs,),
state)``: ``kwargs`` holds the constructor's ``values``, ``offsets``, ``lengths``,
``_ragged_idx``, ``_metadata_cache`` and ``requires_grad``, and ``state`` sets the same
objects again as attributes (and ``_is_param`` for one wrapped in ``nn.Parameter``).
``import torch`` itself puts ``_rebuild_njt`` and ``NestedTensor`` on the weights-only
allowlist (``torch/nested/__init__.py``), so ``torch.load(weights_only=True)`` reads such a
file in a fresh process; the ``torch._dynamo.decorators._DimRange`` objects that an NJT
built by ``nested_tensor`` carries in its metadata cache are allowed once ``torch._dynamo``
is imported, as torch's refusal of them asks, and are allowed here
(:class:`~ckpt_tools.formats.pickle.standins.DimRange`).

The call is described as a :class:`~ckpt_tools.descriptors.RebuiltTensor` of layout
``jagged`` whose parts are every tensor the call holds (values, offsets, lengths, the
cached sequence lengths), so writers copy all their storages. Arguments torch refuses, or
that torch.save never writes, are refused: the description must be exactly what torch builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckpt_tools.descriptors import GlobalRef, RebuiltTensor, TensorRef
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.pickle.rebuilt import Array
from ckpt_tools.formats.pickle.standins import ConstantRef
from ckpt_tools.structure.tensor_walk import iter_stored_tensors

__all__ = [
    "JAGGED_GLOBALS",
    "check_jagged_parts",
    "jagged_arguments",
    "jagged_from_type",
    "jagged_tensor",
]

_MODULE = "torch.nested._internal.nested_tensor"
#: The globals ``import torch`` adds to the weights-only allowlist for NJTs.
JAGGED_GLOBALS = (f"{_MODULE}._rebuild_njt", f"{_MODULE}.NestedTensor")
# The constructor's keywords as torch.save writes them; the state's attributes that repeat them.
_KEYWORDS = frozenset(
    {"values", "offsets", "lengths", "_ragged_idx", "_metadata_cache", "requires_grad"}
)
# State attributes torch.save writes beside them (``_dynamo_*`` markers hold no tensors).
_REPEATED = {
    "_values": "values",
    "_offsets": "offsets",
    "_lengths": "lengths",
    "_ragged_idx": "_ragged_idx",
    "_metadata_cache": "_metadata_cache",
}
_DEFAULTS = {"lengths": None, "_ragged_idx": 1, "_metadata_cache": {}}
_INDEX_DTYPES = frozenset({"int64", "int32"})


def _refuse(why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"the pickle builds a jagged nested tensor whose {why}; refused")


def _checked_kwargs(kwargs: Any) -> dict[str, Any]:
    """The constructor's keywords, checked as torch's ``NestedTensor.__new__`` checks them,
    and against what torch.save writes."""
    if not isinstance(kwargs, dict) or not set(kwargs) <= _KEYWORDS:
        raise _refuse("constructor arguments are not the keywords torch.save writes")
    values, offsets, lengths = kwargs.get("values"), kwargs.get("offsets"), kwargs.get("lengths")
    if not isinstance(values, TensorRef) or not isinstance(offsets, TensorRef):
        raise _refuse("values or offsets are not tensors (torch.load fails on it too)")
    if len(offsets.shape) != 1 or not offsets.shape[0]:
        raise _refuse(
            f"offsets have shape {list(offsets.shape)}, not (batch + 1,) (torch refuses it)"
        )
    if values.device != offsets.device:
        raise _refuse("values and offsets lie on different devices (torch refuses it)")
    if lengths is not None and not (
        isinstance(lengths, TensorRef)
        and lengths.shape == (offsets.shape[0] - 1,)
        and lengths.device == values.device
    ):
        raise _refuse("lengths do not have one entry per component (torch refuses it)")
    if any(t is not None and t.dtype not in _INDEX_DTYPES for t in (offsets, lengths)):
        raise _refuse("offsets or lengths are not integers")
    ragged = kwargs.get("_ragged_idx", 1)
    if type(ragged) is not int or not 1 <= ragged <= len(values.shape):
        raise _refuse(f"ragged dimension {ragged!r} is not one of its values' dimensions")
    cache = kwargs.get("_metadata_cache")
    if cache is not None and not isinstance(cache, dict):
        raise _refuse("metadata cache is not a dict")
    if type(kwargs.get("requires_grad", False)) is not bool:
        raise _refuse("requires_grad is not a bool (torch refuses it)")
    return kwargs


def jagged_tensor(func: GlobalRef, kwargs: Any) -> RebuiltTensor:
    """The recorded call ``_rebuild_njt(kwargs)``, described.

    Args:
        func: ``torch.nested._internal.nested_tensor._rebuild_njt``.
        kwargs: its one argument as unpickled, the ``NestedTensor`` constructor's keywords.

    Returns:
        A :class:`RebuiltTensor` of layout ``jagged``: shaped as torch reports it, with -1
        for the ragged dimension; its parts are every tensor in ``kwargs``.

    Raises:
        CorruptCheckpointError: arguments torch refuses, or that torch.save never writes.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> values = TensorRef(StorageRef("0", "float32", 16, "cpu"), 0, (8, 2), (2, 1), "float32")
        >>> offsets = TensorRef(StorageRef("1", "int64", 3, "cpu"), 0, (3,), (1,), "int64")
        >>> njt = jagged_tensor(GlobalRef(*JAGGED_GLOBALS[0].rsplit(".", 1)),
        ...                     {"values": values, "offsets": offsets})
        >>> njt.shape, njt.layout, len(njt.parts)
        ((2, -1, 2), 'jagged', 2)
    """
    kwargs = _checked_kwargs(kwargs)
    values: TensorRef = kwargs["values"]
    r = kwargs.get("_ragged_idx", 1) - 1
    parts = tuple(dict.fromkeys(t for _, t in iter_stored_tensors(kwargs)))
    return RebuiltTensor(
        GlobalRef(func.module, func.name),
        (kwargs,),
        shape=(kwargs["offsets"].shape[0] - 1, *values.shape[:r], -1, *values.shape[r + 1 :]),
        dtype=values.dtype,
        layout="jagged",
        device=values.device,
        stride=(),
        numel=values.numel,
        parts=parts,
    )


def jagged_from_type(func: GlobalRef, args: tuple[Any, ...], inner: RebuiltTensor) -> RebuiltTensor:
    """``_rebuild_from_type_v2(_rebuild_njt, NestedTensor, (kwargs,), state)`` described:
    ``inner`` (the ``_rebuild_njt`` call's description) with this call to re-emit.

    torch sets each of ``state``'s items as an attribute of the tensor, so one that swapped
    its values, offsets or lengths for other tensors would change what the description says:
    those must be the constructor's own, and no other tensor may hide in the state.

    Raises:
        CorruptCheckpointError: another type than ``NestedTensor``, or such a state.
    """
    new_type, state = args[1], args[3]
    if not (isinstance(new_type, ConstantRef) and new_type.qualname == JAGGED_GLOBALS[1]):
        raise _refuse(f"type is {new_type!r}, not {JAGGED_GLOBALS[1]}")
    kwargs = inner.args[0]
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise _refuse("attribute state is not a dict of names (as torch.save writes it)")
    for name, value in state.items():
        key = _REPEATED.get(name)
        if key is None:
            # ``nn.Parameter(njt)`` marks the tensor with ``_is_param = True`` (what
            # ``isinstance(t, nn.Parameter)`` reads); ``_dynamo_*`` markers hold no tensors.
            if name.startswith("_dynamo_") or (name == "_is_param" and value is True):
                continue
            raise _refuse(f"attribute state sets {name!r}, which torch.save never writes")
        given = kwargs.get(key, _DEFAULTS.get(key))
        if key == "_metadata_cache":  # the constructor keeps ``kwargs.get(...) or {}``
            given = given or {}
        if value is not given and value != given:  # tensors compare by identity
            raise _refuse(f"attribute {name} is not its constructor's {key}")
    if any(t not in inner.parts for _, t in iter_stored_tensors(state)):
        raise _refuse("attribute state holds tensors its constructor does not")
    return replace(inner, func=GlobalRef(func.module, func.name), args=args)


def jagged_arguments(t: RebuiltTensor) -> dict[str, Any]:
    """The constructor keywords of a jagged tensor described by :func:`jagged_tensor` or
    :func:`jagged_from_type` (``values``, ``offsets``, ``lengths``, ``_ragged_idx`` ...)."""
    return t.args[2][0] if t.func.name == "_rebuild_from_type_v2" else t.args[0]


def check_jagged_parts(
    values: Array, offsets: Array, lengths: Array | None, ragged_idx: int
) -> None:
    """Refuse a jagged tensor's parts unless every component lies inside its values.

    torch's constructor does not look at the offsets' numbers; its kernels then index the
    values with them, so one past the ragged dimension reads outside the storage. Component
    ``i`` is ``values`` from ``offsets[i]`` to ``offsets[i + 1]`` along the ragged dimension
    (to ``offsets[i] + lengths[i]`` where lengths are given).

    Args:
        values: the values (their shape is all that is read).
        offsets: ``(batch + 1,)`` offsets along the ragged dimension.
        lengths: ``(batch,)`` lengths, or None.
        ragged_idx: the tensor's ragged dimension (1 for the values' first).

    Raises:
        ValueError: an offset or length is negative, the offsets decrease (without lengths),
            or a component ends past the values' ragged dimension.

    Example:
        >>> import numpy as np
        >>> check_jagged_parts(np.zeros((8, 2)), np.array([0, 3, 9]), None, 1)
        Traceback (most recent call last):
        ...
        ValueError: a component ends at row 9 of its 8-row values
    """
    rows = values.shape[ragged_idx - 1]
    starts = offsets.tolist()
    ends = starts[1:] if lengths is None else [a + n for a, n in zip(starts, lengths.tolist())]
    if any(n < 0 for n in starts) or any(e < a for a, e in zip(starts, ends)):
        raise ValueError("an offset or length is negative, or its offsets decrease")
    last = max([*starts, *ends])
    if last > rows:
        raise ValueError(f"a component ends at row {last} of its {rows}-row values")
