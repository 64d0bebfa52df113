"""The walk over a pickle's opcodes, in its bytes: each opcode's stack effect replayed with
the expanded size of each object in place of the object, arguments read in place.

:mod:`~ckpt_tools.formats.pickle.expansion` runs it before anything is unpickled; the tests
hold it equal to ``pickletools.genops`` (``tests/formats/pickle/test_pickle_expansion.py``).
"""

from __future__ import annotations

import io
import pickletools
import struct
from typing import Any, NamedTuple

from ckpt_tools.errors import ResourceLimitError

__all__ = ["MEMO_SLACK", "OpcodeScan", "scan_bytes"]

#: How far a memo index may run ahead of its position in the pickle (8 MiB of memo table).
MEMO_SLACK = 1 << 20

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


_PLAIN, _MARKS, _DUP, _GET, _PUT = range(5)


def _shape(op: pickletools.OpcodeInfo) -> tuple[int, int, bool, int]:
    """How an opcode moves the stack: (kind, pops below a mark, pops to a mark, pushes)."""
    special = {"MARK": _MARKS, "DUP": _DUP, "MEMOIZE": _PUT}
    kind = special.get(op.name, _GET if op.name in _GETS else _PUT if op.name in _PUTS else _PLAIN)
    marked = _MARK in op.stack_before
    below = op.stack_before.index(_MARK) if marked else len(op.stack_before)
    return kind, below, marked, len(op.stack_after)


_SHAPES = {op.code: _shape(op) for op in pickletools.opcodes}


def scan_bytes(data: bytes, limit: int) -> OpcodeScan:
    """The walk: each opcode's stack effect replayed with sizes for objects, arguments read
    in place (faster than replaying ``pickletools.genops``, which the tests use as the
    oracle: ``tests/formats/pickle/test_pickle_expansion.py``).

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
