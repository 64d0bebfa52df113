"""The re-pickler: writes back a tree that :func:`~.unpickler.load_pickle` read.

The same globals, arguments and sharing come out as went in, so a rewrite changes keys or
device tags and nothing else. Globals are written by name and never imported.
"""

from __future__ import annotations

import codecs
import copyreg
import io
import os
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, BinaryIO

from ckpt_tools.descriptors import GlobalRef, Opaque, StorageRef, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import (
    CheckpointError,
    ConversionError,
    CorruptCheckpointError,
    ResourceLimitError,
    quote_foreign,
    shown,
)
from ckpt_tools.formats.pickle.expansion import WEIGHTS_ONLY_OPCODES, scan_pickle
from ckpt_tools.formats.pickle.limits import check_written_depth, stack_room
from ckpt_tools.formats.pickle.standins import DimRange, Reduced, TorchSize, storage_type_ref
from ckpt_tools.formats.pickle.unpickler import gc_paused

__all__ = [
    "TORCH_PICKLE_PROTOCOL",
    "WEIGHTS_ONLY_OPCODES",
    "Repickler",
    "check_weights_only_pickle",
    "dumps",
    "torch_storage_id",
    "unsupported_opcodes",
    "zip_storage_id",
]

#: The protocol every output pickle uses, whatever the input's: the one ``torch.save`` writes,
#: and the only one whose opcodes ``torch.load(weights_only=True)`` reads (protocol 4 adds
#: FRAME, MEMOIZE, SHORT_BINUNICODE and STACK_GLOBAL, which torch 2.13 rejects).
TORCH_PICKLE_PROTOCOL = 2
# What the C pickler writes for b"" at protocol 2; the pure-Python one is told otherwise.
_BYTES_CALL = b"c__builtin__\nbytes\n"


class _Reductions:
    """How the stand-ins of a tree read by :func:`load_pickle` are pickled (both picklers)."""

    _storage_id: Callable[[StorageRef], tuple[Any, ...]]
    _callables: dict[GlobalRef, _CallableRef]

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            return self._storage_id(obj)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is bytes and not obj:
            # Protocol 2 writes b"" as bytes(), which weights_only refuses; "ab" is written
            # as _codecs.encode("ab", "latin1"), which it takes. (The pure-Python pickler
            # asks here for bytes; the C one does not: see dumps.)
            return (codecs.encode, ("", "latin1"))
        if isinstance(obj, TensorRef):
            return (self._callable(obj.func), obj.args)
        if isinstance(obj, Reduced):
            return (self._callable(obj.func), obj.args)
        if isinstance(obj, TorchSize):
            return (self._callable(GlobalRef("torch", "Size")), (tuple(obj),))
        if isinstance(obj, DimRange):
            # As torch.save writes the frozen slots dataclass: NEWOBJ, then its field list.
            state = list(obj.values) if obj.values is not None else None
            return (copyreg.__newobj__, (DimRange,), state)
        if isinstance(obj, Opaque):
            cls = type(obj)
            func, args = (copyreg.__newobj__, (cls, *obj.args)) if obj.newobj else (cls, obj.args)
            return (
                func,
                args,
                obj.state if obj.has_state else None,
                iter(obj.listitems) if obj.listitems else None,
                iter(obj.dictitems) if obj.dictitems else None,
            )
        return NotImplemented

    def _callable(self, ref: GlobalRef | None) -> _CallableRef:
        # One object per global, so pickle's memo emits each GLOBAL once, as torch does.
        if ref is None:
            raise CorruptCheckpointError("a tensor without a rebuild function cannot be pickled")
        key = GlobalRef(ref.module, ref.name)
        if key not in self._callables:
            self._callables[key] = _CallableRef(ref.module, ref.name)
        return self._callables[key]


class Repickler(_Reductions, pickle._Pickler):  # type: ignore[name-defined]
    """Write a tree read by :func:`load_pickle` back as a torch pickle (pure Python).

    :func:`dumps` writes the same bytes with the C pickler, several times faster; this one
    is their reference (``tests/formats/pickle/test_repickle.py`` compares them).

    Args:
        file: where to write.
        protocol: ignored: outputs always use :data:`TORCH_PICKLE_PROTOCOL`, whatever the
            input's protocol was (kept so callers can pass the source's).
        storage_id: maps each :class:`StorageRef` to the persistent id tuple to write, so a
            writer can rename records or retag devices.

    Example:
        >>> buf = io.BytesIO()
        >>> Repickler(buf, 2, lambda s: ("storage",)).dump({"epoch": 3})
    """

    def __init__(
        self, file: BinaryIO, protocol: int, storage_id: Callable[[StorageRef], tuple[Any, ...]]
    ) -> None:
        super().__init__(file, protocol=TORCH_PICKLE_PROTOCOL)
        self._storage_id = storage_id
        self._callables = {}

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        ref = _global_of(obj)
        if ref is None:
            super().save(obj, save_persistent_id)
            return
        self.framer.commit_frame()
        memoized = self.memo.get(id(obj))
        if memoized is not None:
            self.write(self.get(memoized[0]))
            return
        self.write(pickle.GLOBAL + _global_line(ref))
        self.memoize(obj)


class _FastRepickler(_Reductions, pickle.Pickler):
    """:class:`Repickler` on the C pickler.

    The C pickler writes a GLOBAL only for an object it finds under that name in the
    module the object names, and imports that module: a global that stands in for
    ``torch._utils._rebuild_tensor_v2`` cannot be written as is. Each one is bound instead,
    for the dump, under a placeholder name in its own (ckpt_tools) module, and the
    placeholders are swapped for the real names afterwards (:class:`_Placeholders`).
    """

    def __init__(
        self,
        file: BinaryIO,
        storage_id: Callable[[StorageRef], tuple[Any, ...]],
        names: _Placeholders,
    ) -> None:
        super().__init__(file, protocol=TORCH_PICKLE_PROTOCOL)
        self._storage_id = storage_id
        self._callables = {}
        self._names = names

    def reducer_override(self, obj: Any) -> Any:
        ref = _global_of(obj)
        if ref is not None:
            return self._names.bind(obj, ref)  # a name: the pickler writes GLOBAL module name
        return super().reducer_override(obj)


class _Placeholders:
    """Placeholder global names, bound while one dump runs, then swapped for the real ones.

    The names carry a random token drawn for this dump, so no pickled string can hold one.
    """

    def __init__(self) -> None:
        self._prefix = f"_ckpt_global_{os.urandom(12).hex()}_"
        self._bound: list[tuple[ModuleType, str]] = []
        self._real: dict[tuple[bytes, bytes], bytes] = {}

    def bind(self, obj: Any, ref: GlobalRef) -> str:
        """Bind ``obj`` under a new placeholder in its module; returns the placeholder.

        Raises:
            _Unbindable: ``obj``'s class is not one of ckpt_tools' (a caller's own
                ``GlobalRef`` subclass): its module may be missing, or renamed on the way
                out by the pickler's Python 2 name mapping.
        """
        module_name = getattr(obj, "__module__", None)
        module = sys.modules.get(module_name) if isinstance(module_name, str) else None
        if module is None or not module_name.startswith("ckpt_tools."):
            raise _Unbindable(module_name)
        name = f"{self._prefix}{len(self._bound)}"
        setattr(module, name, obj)
        self._bound.append((module, name))
        self._real[(obj.__module__.encode(), name.encode())] = _global_line(ref)
        return name

    def unbind(self) -> None:
        for module, name in self._bound:
            delattr(module, name)
        self._bound.clear()

    def swap(self, payload: bytes) -> bytes:
        """``payload`` with every placeholder GLOBAL naming its real global."""
        if not self._real:
            return payload
        # The exact module names (each starts "ckpt_tools.", so no byte before the opcode
        # can begin a match), then the name with this dump's token.
        modules = b"|".join(re.escape(m) for m in {m for m, _ in self._real})
        prefix = re.escape(self._prefix.encode())
        pattern = re.compile(pickle.GLOBAL + b"(" + modules + rb")\n(" + prefix + rb"\d+)\n")
        real = self._real
        swapped = pattern.sub(lambda m: pickle.GLOBAL + real[m.group(1), m.group(2)], payload)
        if self._prefix.encode() in swapped:  # a pickler that wrote them otherwise: never ship
            raise ConversionError("a placeholder global was left in the output pickle (a bug)")
        return swapped


class _Unbindable(Exception):
    """A global stand-in the C pickler cannot be handed (:meth:`_Placeholders.bind`)."""


@dataclass(frozen=True)
class _CallableRef(GlobalRef):
    # pickle's save_reduce checks callable(func); the call itself never happens.
    def __call__(self, *args: Any) -> Any:
        raise TypeError(f"{self.qualname} is a reference, never called")


def _global_line(ref: GlobalRef) -> bytes:
    """The argument of the GLOBAL opcode that names ``ref``, as pickle writes it (UTF-8 lines).

    A global read from a STACK_GLOBAL may hold a newline or a lone surrogate, which no GLOBAL
    line can say: written anyway it would name another global, so it is refused.
    """
    try:
        if "\n" not in ref.module and "\n" not in ref.name:
            return f"{ref.module}\n{ref.name}\n".encode()
    except UnicodeEncodeError:
        pass
    raise ConversionError(
        f"the global {shown(ref.qualname)} cannot be written as a protocol 2 GLOBAL (a newline "
        "or a lone surrogate in its name), the only way torch.save and a rewrite name a global"
    )


def _global_of(obj: Any) -> GlobalRef | None:
    if isinstance(obj, GlobalRef):
        return obj
    if isinstance(obj, type) and issubclass(obj, (Opaque, DimRange)):
        return obj.global_ref
    return None


def dumps(obj: Any, protocol: int, storage_id: Callable[[StorageRef], tuple[Any, ...]]) -> bytes:
    """Pickle a tree read by :func:`load_pickle` into bytes (see :class:`Repickler`).

    Raises:
        ConversionError: the tree needs an opcode ``torch.load(weights_only=True)`` rejects
            (an integer over 255 bytes long): nothing would load it.
        ResourceLimitError: its containers nest deeper than a rewrite writes
            (:data:`~ckpt_tools.formats.pickle.limits.MAX_REWRITE_NESTING`).
    """
    check_written_depth(obj)
    buffer = io.BytesIO()
    names = _Placeholders()
    try:
        with gc_paused(), stack_room():
            _FastRepickler(buffer, storage_id, names).dump(obj)
        payload = names.swap(buffer.getvalue())
        if _BYTES_CALL in payload:  # a b"" (read from protocol 3+) the C pickler wrote as bytes()
            raise _Unbindable
    except _Unbindable:
        buffer = io.BytesIO()  # the pure-Python reference writes any GlobalRef by name
        with gc_paused(), stack_room():
            Repickler(buffer, protocol, storage_id).dump(obj)
        payload = buffer.getvalue()
    except RecursionError as e:  # a shape that costs more calls a level than stack_room allows
        raise ResourceLimitError(
            "the object tree nests deeper than the pickler recurses here; torch.load reads it: "
            "write its tensors alone (extract them, or write safetensors without the other entries)"
        ) from e
    finally:
        names.unbind()
    check_weights_only_pickle(payload)
    return payload


def unsupported_opcodes(payload: bytes) -> list[str]:
    """The opcodes of ``payload`` that ``torch.load(weights_only=True)`` rejects, in order.

    Args:
        payload: a pickle (a ``data.pkl`` record).

    Returns:
        Their names, each once; a protocol other than 2 counts as ``PROTO N``.

    Raises:
        ValueError: ``payload`` is not a well-formed pickle.
        ResourceLimitError: its objects expand past the limit (a memo bomb).

    Example:
        >>> unsupported_opcodes(pickle.dumps({"a": 1}, protocol=2))
        []
        >>> unsupported_opcodes(pickle.dumps({"a": 1}, protocol=4))[:2]
        ['PROTO 4', 'FRAME']
    """
    scan = scan_pickle(payload)  # (the same bytes are scanned once per process)
    if scan.malformed is not None:
        raise ValueError(scan.malformed)
    found = [f"PROTO {p}" for p in scan.protocols if p != TORCH_PICKLE_PROTOCOL]
    return found + [name for name in scan.opcodes if name not in WEIGHTS_ONLY_OPCODES]


def check_weights_only_pickle(
    payload: bytes,
    *,
    what: str = "the output pickle",
    error: Callable[[str], CheckpointError] = ConversionError,
) -> None:
    """Refuse a pickle that ``torch.load(weights_only=True)`` could not read.

    Args:
        payload: the pickle.
        what: how messages name it.
        error: makes the refusal from its message (a written archive's check raises its own).

    Raises:
        ConversionError: (or what ``error`` makes) it is malformed, or uses other opcodes
            than :data:`WEIGHTS_ONLY_OPCODES` or a protocol other than 2.
        ResourceLimitError: its objects expand past the limit (a memo bomb).

    Example:
        >>> check_weights_only_pickle(pickle.dumps([1.5, "x"], protocol=2))
        >>> check_weights_only_pickle(pickle.dumps([1.5], protocol=4))
        Traceback (most recent call last):
        ckpt_tools.errors.ConversionError: the output pickle uses ... PROTO 4, FRAME, MEMOIZE
    """
    try:
        bad = unsupported_opcodes(payload)
    except ResourceLimitError:  # a ValueError too: a refusal, not a malformed pickle
        raise
    except ValueError as e:
        raise error(f"{what} is not a well-formed pickle ({quote_foreign(e)})") from e
    if bad:
        big = (
            "; an int of 256 bytes or more needs LONG4, which no rewrite avoids: leave it out"
            if "LONG4" in bad
            else ""
        )
        raise error(
            f"{what} uses opcodes torch.load(weights_only=True) rejects: "
            + ", ".join(bad[:8])
            + big
        )


def torch_storage_id(storage: StorageRef, key: str, device: str) -> tuple[Any, ...]:
    """The persistent id torch's zip format pickles for a storage: the one way ids are made.

    ``("storage", storage class, record key, device tag, element count)``, as ``torch.save``
    writes it. A storage read with its class (every pickled one) keeps it and its count as
    read; one without (safetensors) gets the class ``torch.save`` would name for its dtype,
    counting elements of that class.

    Args:
        storage: the storage to name.
        key: its record name under ``data/`` in the output.
        device: the location tag to write (``"cpu"``, ``"cuda:1"``).

    Returns:
        The persistent id tuple.

    Example:
        >>> torch_storage_id(StorageRef("w", "float32", 6, "cpu"), "0", "cpu")[1:]
        (StorageTypeRef(module='torch', name='FloatStorage'), '0', 'cpu', 6)
    """
    storage_type = storage.storage_type
    if storage_type is not None:
        return ("storage", storage_type, key, device, storage.numel)
    storage_type = storage_type_ref(storage.dtype)
    numel = storage.nbytes // itemsize(storage_type.dtype)
    return ("storage", storage_type, key, device, numel)


def zip_storage_id(device_map: Mapping[str, str] | None = None) -> Callable[[StorageRef], tuple]:
    """Storage ids under their own keys (:func:`torch_storage_id`), optionally retagging devices."""

    def storage_id(storage: StorageRef) -> tuple[Any, ...]:
        device = (device_map or {}).get(storage.device, storage.device)
        return torch_storage_id(storage, storage.key, device)

    return storage_id
