"""The restricted unpickler. Pickles are read, never executed.

``find_class`` never imports anything. Globals on the allowlist (in the spirit of torch's
``weights_only`` unpickler) resolve to the stand-ins of :mod:`ckpt_tools.formats.pickle.allowlist`;
every other global resolves to an :class:`~ckpt_tools.descriptors.Opaque` subclass named after it,
whose instances just record what the pickle did to them. ``persistent_load`` turns torch's
storage ids into :class:`~ckpt_tools.descriptors.StorageRef` s.

:mod:`ckpt_tools.formats.pickle.repickle` writes such a tree back.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import io
import pickle
import struct
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, BinaryIO, NamedTuple

from ckpt_tools.descriptors import StorageRef
from ckpt_tools.errors import (
    CheckpointError,
    CorruptCheckpointError,
    ResourceLimitError,
    UnsafeContentError,
    quote_foreign,
)
from ckpt_tools.formats.pickle.expansion import (
    WEIGHTS_ONLY_OPCODES,
    OpcodeScan,
    checked_scan,
    past_lenient_literal,
)
from ckpt_tools.formats.pickle.limits import LimitedReader
from ckpt_tools.formats.pickle.restricted import RestrictedPyUnpickler, RestrictedUnpickler

__all__ = [
    "MAX_NESTING",
    "MAX_PICKLE_BYTES",
    "ReadResult",
    "gc_paused",
    "load_pickle",
]

# A data.pkl past this size is not a state dict; refusing it bounds what we hold in memory.
MAX_PICKLE_BYTES = 1 << 30
# How deep a path inside DCP metadata may go. A pickle itself may nest as deep as it likes:
# torch's weights-only unpickler keeps its own stack and reads any depth, so every walk over a
# read tree is iterative, and the re-pickler refuses (as torch.save fails) what it cannot write.
MAX_NESTING = 200

# Every built-in exception the unpickler raises on hostile bytes, other than those about size:
# UnpicklingError (bad opcodes, stack underflow), EOFError (truncation), ValueError (bad
# literals, UnicodeDecodeError, int digit limits), TypeError (calls with wrong arguments,
# unhashable keys), LookupError (memo misses, empty stacks), AttributeError and
# RecursionError (hostile nesting), ArithmeticError other than OverflowError.
_MALFORMED = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    LookupError,
    AttributeError,
    RecursionError,
    ZeroDivisionError,
    FloatingPointError,
    struct.error,  # the pure-Python unpickler's (the rescan below)
)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a pickle tree is built or written.

    Building thousands of small containers triggers collections that re-scan the growing
    tree again and again, a large share of reading a big state dict. The trees hold no cycles
    to collect, so pausing costs nothing; the previous state is restored.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class ReadResult(NamedTuple):
    """What one pickle held.

    Attributes:
        root: the object tree.
        storages: storage key -> descriptor, in first-seen order.
        unsafe_globals: qualified names outside the allowlist, in first-seen order.
        protocol: the pickle protocol (0-5) from the PROTO opcode, 0 when absent.
        beyond_weights_only: its opcodes that torch's weights-only unpickler lacks (sorted).
        raw_keys: storage key -> the object the pickle holds for it (``0`` or ``"0"``),
            which torch matches a legacy file's key list against.
    """

    root: Any
    storages: dict[str, StorageRef]
    unsafe_globals: tuple[str, ...]
    protocol: int
    beyond_weights_only: tuple[str, ...] = ()
    raw_keys: Mapping[str, Any] = MappingProxyType({})


def load_pickle(
    file: BinaryIO,
    limit: int = MAX_PICKLE_BYTES,
    persistent_load: Callable[[Any], Any] | None = None,
    storage_id_length: int = 5,
    extra_globals: Mapping[str, Any] | None = None,
) -> ReadResult:
    """Read one pickle from ``file`` with the restricted unpickler.

    The file position is left just past the pickle's STOP opcode, so several pickles written
    one after another (as torch's legacy format does) can be read in turn.

    Args:
        file: a binary file positioned at the start of a pickle.
        limit: refuse pickles longer than this many bytes.
        persistent_load: resolves persistent ids instead of the built-in rule (torch's
            ``("storage", ...)`` tuples -> :class:`StorageRef`); the tar format's main pickle
            names already-read tensors by key. The storages it returns are not collected in
            :attr:`ReadResult.storages`.
        storage_id_length: how many fields torch's reader unpacks from a ``("storage", ...)``
            id: 5 in a torch zip, 6 in a legacy file (the last is the view); others are refused.
        extra_globals: qualified name -> stand-in, allowed for this pickle only (the DCP
            metadata classes of :data:`~ckpt_tools.formats.dcp.globals.DCP_METADATA_GLOBALS`,
            and the ``getattr`` of :class:`~ckpt_tools.formats.dcp.globals.EnumByName`).

    Returns:
        The object tree, the storages it refers to, the globals outside the allowlist.

    Raises:
        CorruptCheckpointError: the bytes are not a valid pickle.
        ResourceLimitError: the pickle is larger than ``limit``.

    Example:
        >>> import io, pickle
        >>> load_pickle(io.BytesIO(pickle.dumps({"epoch": 3}))).root
        {'epoch': 3}
    """
    start = file.tell()
    head = file.read(2)
    file.seek(start)
    protocol = head[1] if len(head) == 2 and head[0] == pickle.PROTO[0] else 0
    source, read_from, scan = _checked_source(file, start, limit)
    unpickler: Any = RestrictedUnpickler(source, persistent_load, storage_id_length, extra_globals)
    read_start = start if read_from is file else 0
    try:
        root = _unpickle(unpickler, scan, file, read_from, read_start, limit)
    except CorruptCheckpointError as e:
        if not _state_not_a_dict(e):
            raise
        # Read again by the Python unpickler whose BUILD takes what torch's does (below).
        read_from.seek(read_start)
        again = read_from if source is read_from else LimitedReader(read_from, limit)
        unpickler = _OrderedDictBuild(again, persistent_load, storage_id_length, extra_globals)
        root = _unpickle(unpickler, scan, file, read_from, read_start, limit)
    return ReadResult(
        root=root,
        storages=unpickler.storages,
        unsafe_globals=tuple(unpickler.unsafe),
        protocol=protocol,
        beyond_weights_only=tuple(sorted(frozenset(scan.opcodes) - WEIGHTS_ONLY_OPCODES)),
        raw_keys=unpickler.raw_keys,
    )


def _state_not_a_dict(error: CorruptCheckpointError) -> bool:
    cause = error.__cause__
    return isinstance(cause, pickle.UnpicklingError) and "state is not a dictionary" in str(cause)


def _dict_state(state: Any) -> bool:
    """A BUILD state the C unpickler takes without ``__setstate__``: None or a dict, or a
    ``(state, slot state)`` pair of those."""
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    return all(part is None or isinstance(part, dict) for part in parts)


def _build_as_torch(self: Any) -> None:
    # torch's weights-only BUILD runs ``inst.__dict__.update(state)`` on an OrderedDict, so any
    # state dict.update takes (an empty list, a list of pairs) sets its attributes there; the
    # C unpickler refuses all but a dict. Any other object is built as the C unpickler builds it.
    state, inst = self.stack[-1], self.stack[-2]
    if getattr(inst, "__setstate__", None) is None and not _dict_state(state):
        if type(inst) is not collections.OrderedDict:
            raise pickle.UnpicklingError("state is not a dictionary")
        self.stack.pop()
        inst.__dict__.update(state)
        return
    _PY_BUILD(self)


_PY_BUILD = pickle._Unpickler.dispatch[pickle.BUILD[0]]  # type: ignore[attr-defined]


class _OrderedDictBuild(RestrictedPyUnpickler):
    """The restricted unpickler, with BUILD as torch's weights-only unpickler runs it on an
    OrderedDict: read only where the C unpickler refused a state that is no dict."""

    dispatch = {**RestrictedPyUnpickler.dispatch, pickle.BUILD[0]: _build_as_torch}


def _checked_source(file: BinaryIO, start: int, limit: int) -> tuple[Any, BinaryIO, OpcodeScan]:
    """Scan the pickle at ``start`` before anything unpickles it, and say what may be read:
    ``(what the unpickler reads, the file that is or holds it, the scan)``.

    The unpickler hashes dict keys, which a memo bomb makes endless, so the scan comes
    first; the file is left at ``start``.
    """
    if isinstance(file, io.BytesIO) and file.getbuffer().nbytes - start <= limit:
        source: Any = file  # in memory and within the limit: read it directly (fastest)
    else:
        source = LimitedReader(file, limit)
    read_from: BinaryIO = file
    try:
        if source is file and start == 0:
            # The whole buffer is the pickle (a zip's data.pkl): as bytes, whose scan a
            # rewrite's verification shares with the writer's check of the same output.
            scan = checked_scan(file.getvalue())
        else:
            scan = checked_scan(source if source is file else LimitedReader(file, limit))
        cut = past_lenient_literal(file, start, scan)
        if cut is not None:
            # The check stopped at a literal the unpicklers read (``I0x1``): they are given
            # nothing past it, so what follows (a memo bomb?) is never built, and they fail.
            file.seek(start)
            read_from = source = io.BytesIO(file.read(cut))
    finally:
        file.seek(start)
    return source, read_from, scan


def _unpickle(
    unpickler: RestrictedUnpickler | RestrictedPyUnpickler,
    scan: OpcodeScan,
    file: BinaryIO,
    read_from: BinaryIO,
    read_start: int,
    limit: int,
) -> Any:
    """Run the restricted unpickler; every failure becomes one of our errors, and a pickle
    that names an unsafe global before it fails is refused as unsafe, as torch refuses it."""
    try:
        with gc_paused():
            root = unpickler.load()
    except CheckpointError as e:
        # Raised on purpose (by persistent_load or a rebuild check) with their own message.
        _refuse_unsafe_first(tuple(unpickler.unsafe), e)
        raise
    except _MALFORMED as e:
        # What pickle's _Unpickler.load_* methods (and the real Python types on the allowlist:
        # set, complex, bytearray, OrderedDict) raise on bytes that are not a valid pickle.
        _refuse_unsafe_first(_unsafe_before(unpickler, read_from, read_start, limit), e)
        if read_from is not file:  # stopped where the check stopped: its reason is the one
            raise CorruptCheckpointError(
                f"the pickle is malformed or truncated at byte {scan.end} ({scan.malformed}; "
                "Python's unpickler reads that literal, and nothing after it was checked)"
            ) from e
        raise CorruptCheckpointError(
            f"the pickle is malformed or truncated ({quote_foreign(e)})"
        ) from e
    except (MemoryError, OverflowError) as e:
        # The unpickler allocates a BINBYTES8/BINUNICODE8/BYTEARRAY8 object of its declared
        # length before reading it, so a lying length fails here (MemoryError, or
        # OverflowError past the address space), before any byte is read.
        _refuse_unsafe_first(tuple(unpickler.unsafe), e)
        raise ResourceLimitError(
            "the pickle declares an object larger than memory allows; a checkpoint's pickle "
            f"holds no such object, so this is not one ({quote_foreign(e)})"
        ) from e
    return root


# On a malformed pickle, up to this many bytes are parsed again as torch parses GLOBAL.
MAX_RESCAN_BYTES = 4 << 20


def _unsafe_before(
    unpickler: RestrictedUnpickler, file: BinaryIO, start: int, limit: int
) -> tuple[str, ...]:
    """The globals outside the allowlist that come before the point where a pickle fails.

    The C unpickler's own record, or, where it has none, the pure-Python unpickler's, which
    parses GLOBAL lines as torch does (see :class:`RestrictedPyUnpickler`).
    """
    if unpickler.unsafe:
        return tuple(unpickler.unsafe)
    try:
        consumed = file.tell() - start
        file.seek(start)
    except (OSError, ValueError):
        return ()
    if consumed > MAX_RESCAN_BYTES:
        return ()
    source = LimitedReader(file, min(limit, consumed + 4096))
    rescan = RestrictedPyUnpickler(
        source, unpickler._persistent_hook, unpickler._id_length, unpickler._extra_globals
    )
    try:
        with gc_paused():
            rescan.load()
    except (CheckpointError, MemoryError, OverflowError, *_MALFORMED):
        pass  # where it fails does not matter: only what it met before
    return tuple(rescan.unsafe)


def _refuse_unsafe_first(names: tuple[str, ...], error: BaseException) -> None:
    """torch's weights-only unpickler refuses a pickle at its first global outside the
    allowlist, so it never reaches a failure after one: refuse it as unsafe, naming them."""
    if names:
        raise UnsafeContentError(
            f"the pickle refers to global(s) outside the allowlist ({', '.join(names)}) "
            f"before it fails ({quote_foreign(error)}); torch.load(weights_only=True) refuses "
            "it at the first of them",
            globals=names,
        ) from error
