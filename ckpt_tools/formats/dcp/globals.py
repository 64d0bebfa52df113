"""The classes a torch.distributed.checkpoint ``.metadata`` pickle names, allowed there as data.

They are never imported: each resolves to a fresh :class:`DataStandIn` subclass that records
its call arguments and BUILD state, and only while that one pickle is read
(:func:`ckpt_tools.formats.pickle.unpickler.load_pickle`'s ``extra_globals``).
"""

from __future__ import annotations

from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import GlobalRef, Opaque
from ckpt_tools.errors import UnsafeContentError
from ckpt_tools.formats.pickle.limits import tree_children

__all__ = [
    "DCP_METADATA_GLOBALS",
    "ENUM_GETATTR",
    "DataStandIn",
    "EnumByName",
    "dcp_metadata_stand_ins",
]


class DataStandIn(Opaque):
    """A class a DCP ``.metadata`` pickle names, allowed there as plain data, never imported.

    Like :class:`~ckpt_tools.descriptors.Opaque` it records the call arguments and the BUILD
    state; :mod:`ckpt_tools.formats.dcp.metadata` reads them back as fields.
    """


# The classes (and enums, and the path class of ``StorageMeta.checkpoint_id``) a DCP
# ``.metadata`` pickle names, under every module path torch has used for them (the
# TensorProperties pair moved in torch 2.3/2.4; pathlib's PosixPath is
# ``pathlib._local.PosixPath`` on Python 3.13+). Allowed only while that one pickle is read,
# never in a checkpoint's data.pkl, which torch.load(weights_only=True) refuses with them.
_DCP = "torch.distributed.checkpoint"
DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    [f"{_DCP}.metadata.{n}" for n in ("Metadata", "TensorStorageMetadata", "StorageMeta")]
    + [f"{_DCP}.metadata.{n}" for n in ("ChunkStorageMetadata", "BytesStorageMetadata")]
    + [f"{_DCP}.metadata.{n}" for n in ("TensorProperties", "_MEM_FORMAT_ENCODING")]
    + [f"{_DCP}.metadata.MetadataIndex", f"{_DCP}.filesystem._StorageInfo"]
    + [
        f"torch.distributed._shard.sharded_tensor.metadata.{n}"
        for n in ("TensorProperties", "MEM_FORMAT_ENCODING")
    ]
    + [f"pathlib.{m}{n}" for m in ("", "_local.") for n in ("PosixPath", "WindowsPath")]
)


#: The global Python 3.11.0-3.11.4 pickle an enum member through: ``getattr(Enum, "NAME")``
#: (3.11.5 and later, like 3.10, pickle it by value: ``Enum(0)``). Allowed in a DCP
#: ``.metadata`` pickle only, and there only in that form (:class:`EnumByName`).
ENUM_GETATTR = "builtins.getattr"
# DCP's memory format enums (the same members, under both module paths), and their members as
# torch defines them: a by-name member is read as the by-value form of the same member.
_ENUMS = frozenset(
    {
        f"{_DCP}.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
    }
)
_MEMBERS = {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2}


class EnumByName:
    """``builtins.getattr`` while one DCP ``.metadata`` pickle is read: only as Python
    3.11.0-3.11.4 call it there, ``getattr(<a DCP memory format enum>, "<member>")``.

    That call gives the stand-in the by-value form (``_MEM_FORMAT_ENCODING(0)``) gives. Any
    other call is refused: ``pickle.load`` would run ``getattr`` with the pickle's arguments,
    and an attribute of a class reaches code (``mro``, dunders, methods). So is any other use
    of it (kept as a value, or given state): see :meth:`refuse_uncalled`.
    """

    __slots__ = ("_enums",)

    def __init__(self, stand_ins: dict[str, type[DataStandIn]]) -> None:
        self._enums = tuple(stand_ins[name] for name in sorted(_ENUMS))

    def __call__(self, *args: Any) -> DataStandIn:
        if (
            len(args) == 2
            and any(args[0] is enum for enum in self._enums)
            and type(args[1]) is str
            and args[1] in _MEMBERS
        ):
            return args[0](_MEMBERS[args[1]])
        shown = ", ".join(_shown(a) for a in args[:3]) + (", ..." if len(args) > 3 else "")
        raise _refused(f"calls getattr({shown})")

    def __setstate__(self, state: Any) -> None:
        raise _refused("gives it state (BUILD)")

    def refuse_uncalled(self, root: Any) -> None:
        """Refuse a tree that holds this getattr itself (named by the pickle, not called).

        Raises:
            UnsafeContentError: ``root`` reaches it.
        """
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if node is self:
                raise _refused("keeps it as a value")
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(tree_children(node) or ())


def _shown(arg: Any) -> str:
    """An argument as the pickle named it: a stand-in class by its global's name."""
    if isinstance(arg, type) and issubclass(arg, DataStandIn):
        return arg.global_ref.qualname
    return short_repr(arg, 60)


def _refused(what: str) -> UnsafeContentError:
    return UnsafeContentError(
        f"its pickle refers to {ENUM_GETATTR} and {what}; only "
        f"getattr(<a DCP memory format enum>, <one of its members>) is read "
        f"(how Python 3.11.0-3.11.4 pickle an enum member)",
        globals=(ENUM_GETATTR,),
    )


def dcp_metadata_stand_ins() -> dict[str, Any]:
    """Fresh stand-in classes for :data:`DCP_METADATA_GLOBALS`, one set per pickle read
    (so nothing one pickle does to a class is seen by the next), and the
    :class:`EnumByName` getattr over them (:data:`ENUM_GETATTR`).

    Example:
        >>> stand_ins = dcp_metadata_stand_ins()
        >>> sorted(stand_ins)[:2]
        ['builtins.getattr', 'pathlib.PosixPath']
        >>> enum = stand_ins["torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"]
        >>> stand_ins["builtins.getattr"](enum, "TORCH_CHANNELS_LAST").args
        (1,)
    """
    classes: dict[str, Any] = {}
    for qualname in sorted(DCP_METADATA_GLOBALS):
        module, _, name = qualname.rpartition(".")
        classes[qualname] = type(name, (DataStandIn,), {"global_ref": GlobalRef(module, name)})
    classes[ENUM_GETATTR] = EnumByName(classes)
    return classes
