"""How large a pickle's objects are once shared references are counted every time they are used.

A pickle can build a tuple of two references to one tuple, and repeat that 60 times in 130
bytes (``DUP``/``TUPLE2`` or memo ``GET``/``TUPLE2``): the objects stay small in memory, as a
shared DAG, but anything that walks them as a tree sees 2**60 nodes. Our own walks count
shared nodes once; Python's ``hash`` does not, and the unpickler hashes every dict key and
set member as it builds them (``SETITEM``, ``ADDITEMS``, ``FROZENSET``), so such a pickle
never finishes loading. This module replays the pickle's stack, with the expanded size of
each object in place of the object, before anything is unpickled.
"""

from __future__ import annotations

import functools
import pickletools
from typing import Any, BinaryIO

from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.pickle.opcode_walk import OpcodeScan, scan_bytes

__all__ = [
    "MAX_EXPANDED_NODES",
    "WEIGHTS_ONLY_OPCODES",
    "OpcodeScan",
    "check_expansion",
    "checked_scan",
    "past_lenient_literal",
    "scan_pickle",
]

#: A checkpoint's pickle expands to about 15 nodes a tensor; this allows millions of tensors,
#: while hashing this many nodes stays quick enough to bound a memo bomb's cost.
MAX_EXPANDED_NODES = 100_000_000

#: The opcodes the unpickler of ``torch.load(weights_only=True)`` executes (read from
#: torch 2.13's ``torch/_weights_only_unpickler.py``); any other opcode makes it fail with
#: "Unsupported operand", while ``weights_only=False`` reads it with the same meaning.
WEIGHTS_ONLY_OPCODES = frozenset(
    {
        "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS",
        "SETITEM", "SETITEMS", "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE",
        "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET",
        "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING",
        "BINPERSID", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1",
    }
)  # fmt: skip


def check_expansion(pickled: Any, limit: int = MAX_EXPANDED_NODES) -> frozenset[str]:
    """Refuse a pickle whose objects, expanded as a tree, exceed ``limit`` nodes.

    Runs in one pass over the opcodes and never builds an object. A pickle that is not
    well-formed is left to the unpickler, which reports it in its own words.

    Args:
        pickled: the pickle's bytes, or a binary file positioned at its start (read up to
            its STOP opcode; the caller restores the position).
        limit: the most nodes any object may expand to.

    Returns:
        The names of the opcodes it holds (as far as it is well-formed).

    Raises:
        ResourceLimitError: an object expands past ``limit`` (a memo bomb).

    Example:
        >>> import pickle
        >>> sorted(check_expansion(pickle.dumps({"w": [1, 2, 3]}, protocol=2)))[:3]
        ['APPENDS', 'BININT1', 'BINPUT']
        >>> bomb = b"\\x80\\x02}N" + b"2\\x86" * 40 + b"N" + b"s."  # {DAG of 2**40 nodes: None}
        >>> check_expansion(bomb)
        Traceback (most recent call last):
        ckpt_tools.errors.ResourceLimitError: the pickle's objects expand to more than ...
    """
    return frozenset(checked_scan(pickled, limit).opcodes)


def checked_scan(pickled: Any, limit: int = MAX_EXPANDED_NODES) -> OpcodeScan:
    """:func:`check_expansion`'s pass, giving the whole :class:`OpcodeScan`.

    Raises:
        ResourceLimitError: as :func:`check_expansion`.
    """
    return scan_pickle(pickled, limit) if isinstance(pickled, bytes) else _scan(pickled, limit)


def scan_pickle(payload: bytes, limit: int = MAX_EXPANDED_NODES) -> OpcodeScan:
    """One checked pass over ``payload``'s opcodes, remembered for the same bytes.

    A rewrite's output pickle is checked when it is made, when its archive is verified and
    when it is read back: the same bytes, scanned once (the last few payloads up to 64 MiB
    are remembered). The expansion check always runs, so a result is only ever remembered
    for a pickle that passed it.

    Args:
        payload: a whole pickle.
        limit: as :func:`check_expansion`'s.

    Returns:
        The :class:`OpcodeScan`.

    Raises:
        ResourceLimitError: as :func:`check_expansion`.

    Example:
        >>> import pickle
        >>> scan_pickle(pickle.dumps(None, protocol=2))
        OpcodeScan(opcodes=('PROTO', 'NONE', 'STOP'), protocols=(2,), malformed=None, end=4)
    """
    if len(payload) > _REMEMBERED_BYTES:
        return _scan(payload, limit)
    return _remembered_scan(payload, limit)


# The cache keeps its payloads alive: only pickles of a usual size (a few MiB holds a
# state dict of tens of thousands of tensors) are remembered.
_REMEMBERED_BYTES = 64 << 20


@functools.lru_cache(maxsize=4)
def _remembered_scan(payload: bytes, limit: int) -> OpcodeScan:
    return _scan(payload, limit)


def _scan(pickled: Any, limit: int) -> OpcodeScan:
    return (
        scan_bytes(pickled, limit) if isinstance(pickled, bytes) else _scan_stream(pickled, limit)
    )


def _scan_stream(pickled: Any, limit: int) -> OpcodeScan:
    """A pickle in a file: its bytes read as ``pickletools.genops`` reads them, then walked.

    genops reads up to the STOP and no further, and through a
    :class:`~ckpt_tools.formats.pickle.limits.LimitedReader` a declared length past the limit is
    refused before it is read; the bytes it read are then walked by
    :func:`~ckpt_tools.formats.pickle.opcode_walk.scan_bytes`, which reports a malformed
    pickle where genops stopped, in its words.
    """
    read = _Recorded(pickled)
    try:
        for _ in pickletools.genops(read):
            pass
    except ResourceLimitError:  # a ValueError too, and a refusal: not where genops stopped
        raise
    except ValueError as e:
        if isinstance(e, OSError):  # io.UnsupportedOperation: the reader, not the pickle
            raise
    return scan_bytes(bytes(read.data), limit)


class _Recorded:
    """A binary reader that keeps every byte read through it (genops's reads)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.data = bytearray()

    def read(self, n: int = -1) -> bytes:
        data = self._file.read(n)
        self.data += data
        return data

    def readline(self) -> bytes:
        data = self._file.readline()
        self.data += data
        return data


# Opcodes whose text argument Python's unpicklers parse more loosely than the check's walk
# (pickletools): ints in any base (``I0x1``), floats, quoted strings.
_TEXT_LITERALS = frozenset(b"ILFSV")
_MAX_LITERAL = 4 << 20


def past_lenient_literal(file: BinaryIO, start: int, scan: OpcodeScan) -> int | None:
    """Where the text literal that stopped the check ends, from ``start``; None when the
    check stopped elsewhere (the unpicklers then fail where it did)."""
    if scan.malformed is None or scan.end is None:
        return None
    file.seek(start + scan.end)
    head = file.read(1)
    if not head or head[0] not in _TEXT_LITERALS:
        return None
    line = file.readline(_MAX_LITERAL)
    return scan.end + 1 + len(line) if line.endswith(b"\n") else None
