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
import io
import pickletools
import struct
from typing import Any, BinaryIO, NamedTuple

from ckpt_tools.errors import ResourceLimitError

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

#: How far a memo index may run ahead of its position in the pickle (8 MiB of memo table).
MEMO_SLACK = 1 << 20

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

_MARK = pickletools.markobject
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


class OpcodeScan(NamedTuple):
    """What one pass over a pickle's opcodes found.

    Attributes:
        opcodes: the opcode names, each once, in the order they first appear.
        protocols: the PROTO opcodes' arguments, each once, in order (empty without one).
        malformed: why the bytes are not a well-formed pickle (None when they are); the
            names above are those read before that point.
        end: where the walk stopped, from the pickle's start: just past its STOP, or at the
            opcode it could not read. The unpickler must not read past it: it accepts some
            arguments this walk refuses (``I0x1``), and what follows was never checked.
    """

    opcodes: tuple[str, ...]
    protocols: tuple[int, ...]
    malformed: str | None
    end: int | None = None


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
        _scan_bytes(pickled, limit) if isinstance(pickled, bytes) else _scan_stream(pickled, limit)
    )


def _expands_past(limit: int) -> ResourceLimitError:
    return ResourceLimitError(
        f"the pickle's objects expand to more than {limit:,} nodes when shared references "
        "are followed (a memo bomb); a checkpoint's pickle holds a few dozen a tensor, so "
        "this is not one"
    )


def _memo_too_far(index: int, pos: int | None) -> ResourceLimitError:
    # The C unpickler grows its memo array to the index (zero-filled): a PUT 2**31 spends
    # 16 GiB. Picklers number entries 0, 1, 2 ..., so an index never exceeds the bytes
    # before it.
    return ResourceLimitError(
        f"the pickle stores an object at memo index {index:,} at byte {pos}; an unpickler "
        "would allocate a table that large, and no pickler writes such an index, so this is "
        "not a checkpoint"
    )


def _scan_stream(pickled: Any, limit: int) -> OpcodeScan:
    """A pickle in a file: its bytes read as ``pickletools.genops`` reads them, then walked.

    genops reads up to the STOP and no further, and through a
    :class:`~ckpt_tools.formats.pickle.limits.LimitedReader` a declared length past the limit is
    refused before it is read; the bytes it read are then walked by :func:`_scan_bytes`,
    which reports a malformed pickle where genops stopped, in its words.
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
    return _scan_bytes(bytes(read.data), limit)


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


_PLAIN, _MARKS, _DUP, _GET, _PUT = range(5)


def _shape(op: pickletools.OpcodeInfo) -> tuple[int, int, bool, int]:
    """How an opcode moves the stack: (kind, pops below a mark, pops to a mark, pushes)."""
    special = {"MARK": _MARKS, "DUP": _DUP, "MEMOIZE": _PUT}
    kind = special.get(op.name, _GET if op.name in _GETS else _PUT if op.name in _PUTS else _PLAIN)
    marked = _MARK in op.stack_before
    below = op.stack_before.index(_MARK) if marked else len(op.stack_before)
    return kind, below, marked, len(op.stack_after)


_SHAPES = {op.code: _shape(op) for op in pickletools.opcodes}


def _scan_bytes(data: bytes, limit: int) -> OpcodeScan:
    """The walk: each opcode's stack effect replayed with sizes for objects, arguments read
    in place (faster than replaying ``pickletools.genops``, which the tests use as the
    oracle: ``tests/formats/test_pickle_expansion.py``).

    Only PROTO's and the memo opcodes' arguments are decoded, and strings are checked as
    genops checks them (UTF-8). A newline-ended argument is read by pickletools' own reader,
    and so is an argument running past the end, so a malformed pickle fails in genops'
    words.
    """
    seen: dict[int, None] = {}  # opcode bytes, in first-seen order
    protocols: dict[int, None] = {}
    end, malformed = _walk(data, limit, seen, protocols)
    names = tuple(pickletools.code2op[chr(code)].name for code in seen)
    return OpcodeScan(names, tuple(protocols), malformed, end)


def _walk(
    data: bytes, limit: int, seen: dict[int, None], protocols: dict[int, None]
) -> tuple[int, str | None]:
    """Replay ``data``'s opcodes up to STOP, noting each opcode and PROTO version met.

    One loop with the stack effects written out in it: it runs once per opcode, millions of
    times for a large state dict, so only the string arguments take a call (:func:`_sized_end`).

    Returns:
        ``(where STOP ends, None)``, or for a malformed pickle ``(where the opcode that
        failed starts, genops' message)``.

    Raises:
        ResourceLimitError: an object expands past ``limit``, or a memo index runs too far.
    """
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    push, pop, end, pos, at = stack.append, stack.pop, len(data), 0, 0
    try:
        while True:
            at = pos
            if pos >= end:
                raise ValueError("pickle exhausted before seeing STOP")
            code = data[pos]
            entry = _FAST[code]
            if entry is None:
                raise ValueError(f"at position {at}, opcode {bytes([code])!r} unknown")
            kind, below, marked, after, how, valued = entry
            pos += 1
            arg = None
            if how > 0:  # a fixed width
                if pos + how > end:
                    arg, pos = _read_arg(data, at)  # (raises)
                if valued:
                    arg = data[pos] if how == 1 else _UINT32(data, pos)[0]
                    if code == _PROTO:
                        protocols[arg] = None
                pos += how
            elif how == _NEWLINE:
                arg, pos = _read_arg(data, at)
            elif how:
                pos = _sized_end(data, at, how)
            seen[code] = None  # (once its argument reads, as genops yields it)
            if kind == _PUT:
                if arg is not None and arg > at + MEMO_SLACK:
                    raise _memo_too_far(arg, at)
                memo[len(memo) if arg is None else arg] = stack[-1] if stack else 1
            elif kind == _GET:
                push(memo.get(arg, 1))
            elif kind == _PLAIN:
                size = 1
                if marked:
                    mark = marks.pop() if marks else 0
                    size += sum(stack[mark:])
                    del stack[mark:]
                while below and stack:  # (each object missing from the stack counts 1)
                    size += pop()
                    below -= 1
                size += below
                if size > limit:
                    raise _expands_past(limit)
                if after:  # a plain opcode pushes at most one object (DUP is not plain)
                    push(size)
                elif code == _STOP:
                    return pos, None
            elif kind == _MARKS:
                marks.append(len(stack))
            else:  # _DUP
                push(stack[-1] if stack else 1)
    except ResourceLimitError:  # a ValueError too: a refusal, not a malformed pickle
        raise
    except ValueError as e:
        return at, str(e)


def _sized_end(data: bytes, at: int, how: int) -> int:
    """Where the argument of the opcode at ``at`` ends: a little-endian length (``how``, a
    key of :data:`_LENGTHS`), then that many bytes, checked as UTF-8 where genops decodes
    them so.

    Raises:
        ValueError: the length is negative or runs past the end (pickletools' words), or
            the bytes are not UTF-8.
    """
    width, signed, utf8 = _LENGTHS[how]
    head = at + 1 + width
    n = int.from_bytes(data[at + 1 : head], "little", signed=signed)
    if head > len(data) or n < 0 or head + n > len(data):
        return _read_arg(data, at)[1]  # (raises, in pickletools' words)
    if utf8:
        str(data[head : head + n], "utf-8", "surrogatepass")
    return head + n


def _read_arg(data: bytes, at: int) -> tuple[Any, int]:
    """The argument of the opcode at ``at`` read by pickletools, and where it ends."""
    stream = io.BytesIO(data)
    stream.seek(at + 1)
    arg = pickletools.code2op[chr(data[at])].arg.reader(stream)  # type: ignore[union-attr]
    return arg, stream.tell()


# How _scan_bytes reads an opcode's argument (``how``): 0 none, > 0 a fixed width,
# _NEWLINE by pickletools, else a key of _LENGTHS: a little-endian length of some width,
# then that many bytes (checked as UTF-8 where genops decodes them so).
_NEWLINE = pickletools.UP_TO_NEWLINE
_UTF8 = -10
_WIDTHS = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}
_LENGTHS = {
    **{n: (width, signed, False) for n, (width, signed) in _WIDTHS.items()},
    **{n + _UTF8: (width, signed, True) for n, (width, signed) in _WIDTHS.items()},
}
_UTF8_READERS = (
    pickletools.read_unicodestring1,
    pickletools.read_unicodestring4,
    pickletools.read_unicodestring8,
)
# The opcodes whose argument the walk decodes: one byte, or (LONG_BINGET, LONG_BINPUT) four.
_VALUED = frozenset({"PROTO", "BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT"})
_UINT32 = struct.Struct("<I").unpack_from
_BY_CODE = {ord(op.code): op for op in pickletools.opcodes}
_PROTO, _STOP = (ord(op.code) for op in pickletools.opcodes if op.name in ("PROTO", "STOP"))


def _how(op: pickletools.OpcodeInfo) -> int:
    if op.arg is None:
        return 0
    if op.arg.n >= 0 or op.arg.n == _NEWLINE:
        return op.arg.n
    return op.arg.n + (_UTF8 if op.arg.reader in _UTF8_READERS else 0)


# Per opcode byte: its _SHAPES entry, then how its argument is read and whether its value
# is needed; None for a byte that is no opcode.
_FAST: list[tuple[int, int, bool, int, int, bool] | None] = [
    (*_SHAPES[op.code], _how(op), op.name in _VALUED) if (op := _BY_CODE.get(code)) else None
    for code in range(256)
]


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
