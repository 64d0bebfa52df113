"""What each entry of a diff's side is: a tensor (compared), a tensor of a subclass a file
records and the reader does not rebuild (:class:`Foreign`, never compared), or another entry
(a string, a number ...: its kind, compared with nothing).

Some tensors are not plain ones:

* A DTensor (an FSDP2 model's parameters and its ``state_dict()``) has its elements spread
  over the ranks of its mesh. Where none is needed to see it whole (a mesh of one rank, or
  only ``Replicate`` placements), its local tensor is the whole tensor, and is compared.
  Elsewhere its dtype and shape are (``values=False``), and comparing its values is refused:
  gathering them (``full_tensor()``) is a collective, which hangs unless every rank of the
  mesh makes the same call at the same time.
* A lazy module's uninitialized parameter or buffer has no shape until it is loaded
  (``load_state_dict`` gives it the checkpoint's): its shape is None, said "uninitialized".
* A tensor subclass that ``torch.save`` records by ``torch._tensor._rebuild_from_type_v2``
  with no storage of its own (a DTensor of an FSDP2 state dict saved as it is) is not rebuilt
  by the reader: it is a :class:`Foreign` tensor, reported with its class (and its dtype and
  shape, where the record gives them), never compared.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_tools._escape import short_repr, shown
from ckpt_tools.descriptors import GlobalRef, Opaque, RebuiltTensor, Reduced, StorageRef
from ckpt_tools.errors import KeyCollisionError, Remedy, UsageError

__all__ = [
    "SUBCLASS_REBUILD",
    "Foreign",
    "foreign_tensor",
    "is_uninitialized",
    "kind_of",
    "local_tensors",
    "metadata_of",
    "split_entries",
]

#: How ``torch.save`` records a tensor subclass (``Tensor.__reduce_ex__``).
SUBCLASS_REBUILD = "torch._tensor._rebuild_from_type_v2"
#: The rebuild of a wrapper subclass (no storage of its own), whose arguments say its class,
#: dtype, shape, strides, offset, layout, device and ``requires_grad``.
_WRAPPER_REBUILD = "_rebuild_wrapper_subclass"

#: How to hand a diff an FSDP2 model's weights whole.
FULL_STATE_DICT = (
    "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
    "options=StateDictOptions(full_state_dict=True))"
)


@dataclass(frozen=True)
class Foreign:
    """A tensor of a subclass the reader does not rebuild.

    Attributes:
        kind: its class, qualified (``torch.distributed.tensor.DTensor``).
        dtype: its dtype, or ``kind`` where the record does not say.
        shape: its shape (a DTensor's global one), or ``()`` where the record does not say.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]


def _qualname(obj: Any) -> str:
    ref = getattr(obj, "global_ref", None)  # an Opaque class the unpickler made
    if ref is not None:
        return str(ref.qualname)
    qualname = getattr(obj, "qualname", None)  # a GlobalRef or ConstantRef
    return str(qualname) if isinstance(qualname, str) else "tensor subclass"


def foreign_tensor(value: Any) -> Foreign | None:
    """What a file's entry is, where it is a tensor subclass the reader does not rebuild.

    Example:
        >>> from ckpt_tools.descriptors import GlobalRef
        >>> rec = Reduced(GlobalRef("torch._tensor", "_rebuild_from_type_v2"), (None, None, ()))
        >>> foreign_tensor(rec)
        Foreign(kind='tensor subclass', dtype='tensor subclass', shape=())
        >>> foreign_tensor({"w": 1}) is None
        True
    """
    if not isinstance(value, Reduced) or isinstance(value, RebuiltTensor):
        return None
    if value.func.qualname != SUBCLASS_REBUILD or len(value.args) < 3:
        return None
    func, cls, args = value.args[0], value.args[1], value.args[2]
    kind = _qualname(cls)
    dtype, shape = kind, ()
    if getattr(func, "name", None) == _WRAPPER_REBUILD and isinstance(args, tuple):
        name = getattr(args[1], "name", None) if len(args) > 2 else None
        size = args[2] if len(args) > 2 else None
        sized = isinstance(size, tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) for n in size
        )
        if isinstance(name, str) and sized:
            dtype, shape = name, tuple(size)
    return Foreign(kind, dtype, shape)


def is_uninitialized(value: Any) -> bool:
    """Whether an in-memory tensor is a lazy module's uninitialized parameter or buffer."""
    import torch

    return bool(torch.nn.parameter.is_lazy(value))


def _dtensor_type() -> type | None:
    # Only a program that imported torch.distributed.tensor can hold a DTensor.
    module = sys.modules.get("torch.distributed.tensor")
    found = getattr(module, "DTensor", None)
    return found if isinstance(found, type) else None


def _whole_locally(value: Any) -> Any:
    """A DTensor's local tensor where it is the whole tensor (no collective needed); None
    where it is not."""
    if value.device_mesh.size() != 1 and not all(p.is_replicate() for p in value.placements):
        return None
    local = value.to_local()
    return local if tuple(local.shape) == tuple(value.shape) else None


def local_tensors(entries: Mapping[str, Any], label: str, values: bool) -> dict[str, Any]:
    """``entries`` with each DTensor replaced by its local tensor, where that is the whole one.

    A DTensor whose local tensor is only part of it is kept (its dtype and shape are its
    global ones, known without a collective) where values are not compared.

    Args:
        entries: a state dict's or a module's tensors, by name.
        label: the side, for the message (``A``, ``B``).
        values: whether values will be compared.

    Returns:
        A new dict, in the same order.

    Raises:
        UsageError: values are compared and a DTensor is sharded (or partial) over more than
            one rank: the message names it and how to get a full state dict.
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return dict(entries)
    out = {}
    for name, value in entries.items():
        if isinstance(value, dtensor):
            local = _whole_locally(value)
            if local is None and values:
                raise _sharded(label, name, value)
            value = value if local is None else local
        out[name] = value
    return out


def _sharded(label: str, name: str, value: Any) -> UsageError:
    placements = ", ".join(map(repr, value.placements))
    return UsageError(
        f"diff side {label}: {name!r} is a DTensor spread over {value.device_mesh.size()} ranks "
        f"({placements}); seeing its values whole takes a collective that every rank would "
        "have to join, so diff does not compare them",
        remedies=(
            Remedy(text=f"pass its full state dict, taken on every rank: {FULL_STATE_DICT}"),
            Remedy(
                "values",
                "False",
                flag="--no-values",
                text="to compare keys, shapes and dtypes only",
            ),
        ),
    )


def kind_of(value: Any) -> str:
    """What a non-tensor entry is: its type's name, or the global a stand-in names.

    Example:
        >>> kind_of(3), kind_of(None), kind_of({"a": 1})
        ('int', 'None', 'dict')
    """
    if value is None:
        return "None"
    if isinstance(value, Opaque):
        return type(value).global_ref.qualname
    if isinstance(value, Reduced):
        return value.func.qualname
    if isinstance(value, GlobalRef):
        return value.qualname
    return "storage" if isinstance(value, StorageRef) else type(value).__name__


def _foreign(value: Any, tensor_type: type | tuple[type, ...]) -> Foreign | None:
    """A tensor diff does not read: a subclass the reader does not rebuild, or a tuple or
    list of tensors (a quantized module's ``_packed_params``: its weight and bias), which is
    not passed over as a value that is no tensor (and two such never called identical)."""
    items = value if type(value) in (tuple, list) else ()
    if any(isinstance(v, tensor_type) for v in items) and all(
        v is None or isinstance(v, tensor_type) for v in items
    ):
        kind = f"{type(value).__name__} of {len(value)} tensors"
        return Foreign(kind, kind, ())
    return foreign_tensor(value)


def split_entries(
    sd: Mapping[str, Any], tensor_type: type | tuple[type, ...]
) -> tuple[dict[str, Any], dict[str, Foreign], dict[str, str], dict[str, Any]]:
    """``sd``'s tensors by name, its foreign tensors (a file's), the kind of each other entry,
    and those other entries themselves.

    Raises:
        KeyCollisionError: two keys have one name (``0`` and ``"0"``): entries are compared
            by name, and one would hide the other.

    Example:
        >>> entries, foreign, kinds, values = split_entries({"w": 1.5, "epoch": 3}, float)
        >>> list(entries), foreign, kinds, values
        (['w'], {}, {'epoch': 'int'}, {'epoch': 3})
    """
    entries: dict[str, Any] = {}
    foreign: dict[str, Foreign] = {}
    kinds: dict[str, str] = {}
    values: dict[str, Any] = {}
    named: dict[str, Any] = {}
    for key, value in sd.items():
        name = str(key)
        if name in named:  # (a mapping's keys are distinct: another key with its text)
            raise KeyCollisionError(
                f"keys {short_repr(named[name])} and {short_repr(key)} are both named "
                f"{shown(name)!r}: a diff compares entries by name, and one would hide the other",
                ((name, (repr(named[name]), repr(key))),),
            )
        named[name] = key
        found = None if isinstance(value, tensor_type) else _foreign(value, tensor_type)
        if isinstance(value, tensor_type):
            entries[name] = value
        elif found is not None:
            foreign[name] = found
        else:
            kinds[name], values[name] = kind_of(value), value
    return entries, foreign, kinds, values


def metadata_of(sd: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A state dict's ``_metadata`` (the module versions torch saves), where it is a mapping."""
    metadata = getattr(sd, "_metadata", None)
    return metadata if isinstance(metadata, Mapping) else None
