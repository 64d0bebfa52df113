"""The restricted unpicklers' find_class and persistent_load, for the C unpickler and the
pure-Python one (the rescan that names what came before a failure).

``find_class`` never imports anything: globals on the allowlist resolve to the stand-ins of
:mod:`ckpt_tools.formats.pickle.allowlist`, every other one to an
:class:`~ckpt_tools.descriptors.Opaque` subclass named after it. ``persistent_load`` turns
torch's storage ids into :class:`~ckpt_tools.descriptors.StorageRef` s.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import GlobalRef, Opaque, StorageRef
from ckpt_tools.dtypes import BY_NAME_STORAGE_TYPES
from ckpt_tools.errors import CorruptCheckpointError, shown
from ckpt_tools.formats.pickle.allowlist import resolve_allowed
from ckpt_tools.formats.pickle.imports import python3_name
from ckpt_tools.formats.pickle.standins import (
    StorageTypeRef,
    id_text,
    is_count,
    module_record,
    storage_location,
)

__all__ = ["RestrictedPyUnpickler", "RestrictedUnpickler"]


class _Restricted:
    """find_class and persistent_load, for the C unpickler and for the pure-Python one."""

    def __init__(
        self,
        file: BinaryIO,
        persistent_load: Callable[[Any], Any] | None = None,
        id_length: int = 5,
        extra_globals: Mapping[str, Any] | None = None,
    ) -> None:
        # torch.load's default; Python 2 str objects are decoded as UTF-8 text.
        super().__init__(file, encoding="utf-8")  # type: ignore[call-arg]
        self.storages: dict[str, StorageRef] = {}
        # Each key's text -> the object the pickle holds, which torch keys its storages by.
        self.raw_keys: dict[str, Any] = {}
        # A legacy file's root keys, and its views' keys with what each views.
        self._roots: set[str] = set()
        self._views: dict[str, tuple[str, int, int]] = {}
        self.unsafe: dict[str, type[Opaque]] = {}
        self._persistent_hook = persistent_load
        self._id_length = id_length
        self._extra_globals = extra_globals or {}

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 0-2 pickles (torch.save writes 2) name globals as Python 2 did
        # (``__builtin__.set``); Python's own find_class, which this replaces, and torch's
        # weights-only unpickler map them to Python 3 names before any check. Unknown
        # globals keep the name as written, so a rewrite re-emits them unchanged.
        py3 = python3_name(module, name)
        extra = self._extra_globals.get(f"{py3[0]}.{py3[1]}")
        if extra is not None:
            return extra
        allowed = resolve_allowed(*py3)
        if allowed is not None:
            return allowed
        qualname = f"{module}.{name}"
        if qualname not in self.unsafe:
            # torch.load (weights_only=False) resolves a global named like a typed storage
            # class in *any* module to a StorageType, which cannot be called; its table has
            # no UntypedStorage, which it imports as written.
            base = _UncallableStorageType if name in BY_NAME_STORAGE_TYPES else Opaque
            # A GLOBAL line may hold a NUL, a STACK_GLOBAL name a lone surrogate: type()
            # takes neither, so the class is named by the escaped form; global_ref keeps the name.
            ref = GlobalRef(module, name)
            self.unsafe[qualname] = type(shown(name), (base,), {"global_ref": ref})
        return self.unsafe[qualname]

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent_hook is not None:
            return self._persistent_hook(pid)
        if not isinstance(pid, tuple) or not pid:
            raise CorruptCheckpointError(f"unexpected persistent id {short_repr(pid)}")
        kind = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if kind == "module":  # legacy whole-module saves: the class (an Opaque type)
            return module_record(pid[1:])
        # torch unpacks the id into exactly its names: 5 in a zip's data.pkl, 6 (with the view)
        # in a legacy file; any other length fails there ("too many values to unpack").
        if kind != "storage":
            raise CorruptCheckpointError(f"unexpected persistent id {short_repr(pid)}")
        if len(pid) != self._id_length:
            # A sixth field is a legacy storage view, which torch's zip reader does not take.
            what = "a legacy storage view" if len(pid) == 6 else "a storage id"
            raise CorruptCheckpointError(
                f"unexpected persistent id {short_repr(pid)}: {what} of {len(pid)} fields, "
                f"where torch's reader of this format unpacks {self._id_length}"
            )
        storage_type, key, numel = pid[1], self._key_text(pid[2]), pid[4]
        location = storage_location(pid[3])
        if (
            not isinstance(storage_type, StorageTypeRef)
            or key is None
            or location is None
            or not is_count(numel)
        ):
            raise CorruptCheckpointError(f"unexpected storage id {short_repr(pid)}")
        view = _storage_view(pid[5], key, numel) if len(pid) == 6 else None
        self._check_view_keys(key, view)
        cache_key = key if view is None else f"{key}@{view[0]}"
        found = self.storages.get(cache_key)
        # torch keeps a loaded storage for the next reference to its key only when it holds
        # bytes: an empty one is made anew for each, of that reference's own type (torch.save
        # writes empty views of several dtypes under one key); one with bytes is reused.
        if found is not None and found.numel > 0:
            return found
        made = StorageRef(
            key=key,
            dtype=storage_type.dtype,
            numel=numel,
            device=location,
            storage_type=storage_type,
            view=view,
        )
        if found is None or numel > 0:  # the key's storage: the first that holds bytes
            self.storages[cache_key] = made
        return made

    def _key_text(self, raw: Any) -> str | None:
        """A storage key as text, refused where another key of that text is another object.

        torch keys storages by the object (``"0"`` and ``0`` are two storages) and names a
        zip's record ``data/{key}`` as Python formats it (``data/b'0'`` for ``b"0"``).

        Raises:
            CorruptCheckpointError: two keys torch keeps apart have one text.
        """
        if self._id_length == 5 and isinstance(raw, bytes):
            key: str | None = str(raw)
        else:
            key = id_text(raw)
        seen = self.raw_keys.setdefault(key, raw) if key is not None else raw
        if type(seen) is not type(raw) or seen != raw:
            raise CorruptCheckpointError(
                f"storage keys {short_repr(seen)} and {short_repr(raw)} read as one key, "
                f"{key!r}; torch keeps them apart as two storages, which this reader does not"
            )
        return key

    def _check_view_keys(self, key: str, view: tuple[str, int, int] | None) -> None:
        """Refuse keys that torch's legacy reader would resolve otherwise: it keeps root
        storages and views in one table by key, the first object under a key wins, and a
        file's bytes are read into whatever holds the key. torch.save never shares them."""
        seen = self._views.get(view[0]) if view is not None else None
        if key in self._views or (
            view is not None
            and (view[0] in self._roots | {key} or seen not in (None, (key, *view[1:])))
        ):
            raise CorruptCheckpointError(
                f"storage key {key!r}{f' (view {view[0]!r})' if view else ''} is both a storage's "
                "and a storage view's, or two views'; torch's legacy reader takes one for "
                "the other, and torch.save never writes that"
            )
        self._roots.add(key)
        if view is not None:
            self._views[view[0]] = (key, view[1], view[2])


def _storage_view(view: Any, key: str, numel: int) -> tuple[str, int, int] | None:
    """A legacy storage id's view field checked: ``(view key, offset, elements)``, or None."""
    if view is None:
        return None
    view_key = id_text(view[0]) if isinstance(view, tuple) and len(view) == 3 else None
    if view_key is None or not (is_count(view[1]) and is_count(view[2])):
        raise CorruptCheckpointError(f"unexpected storage view {short_repr(view)}")
    if view[1] + view[2] > numel:
        # Its bytes would run into the next storage's; the tar reader refuses too.
        raise CorruptCheckpointError(
            f"storage view {view_key} ({view[2]} elements at {view[1]}) does not fit "
            f"in storage {key!r} of {numel} elements"
        )
    return (view_key, view[1], view[2])


class _UncallableStorageType(Opaque):
    """An unlisted global named like a storage class (``torch._utils.FloatStorage``).

    torch.load's full unpickler turns it into a ``StorageType``, whatever its module; calling
    that fails ("'StorageType' object is not callable"), and so does building it here. Used as
    a value it stays an unsafe global, named as any other.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Opaque:
        raise CorruptCheckpointError(
            f"the pickle calls {cls.global_ref.qualname}, which torch.load resolves to a storage "
            f"type ({cls.global_ref.name}) that cannot be called; torch refuses the file too"
        )


class RestrictedUnpickler(_Restricted, pickle.Unpickler):
    """The one that reads (C, fast)."""


class RestrictedPyUnpickler(_Restricted, pickle._Unpickler):  # type: ignore[name-defined,misc]
    """The one that parses GLOBAL as torch's weights-only unpickler does, used on failures only.

    Both split a GLOBAL opcode's module and name on newlines and drop each line's last byte,
    but the C unpickler refuses an empty line (``cposix\\n\\n``) or a last line without its
    newline as truncation before it asks ``find_class``; this one, like torch, names the global.
    """
