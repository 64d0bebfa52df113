"""A pickle's opcodes read as the C unpickler reads them, without running any.

Only the arguments an import walk uses are decoded (strings, memo indices, a GLOBAL's module
and name); :mod:`~ckpt_tools.formats.pickle.imports` replays them to name every import.
"""

from __future__ import annotations

import codecs
import pickletools
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["STRINGS", "CutGlobal", "read_opcodes"]

#: The opcodes that push a string (text, or a Python 2 ``str`` as bytes).
STRINGS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE"}
    | {"BINUNICODE8"}
)


class CutGlobal(ValueError):
    """A GLOBAL or INST whose lines the file ends inside, with the names torch's weights-only
    reader takes from them: each line less its last byte, newline or not."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__("the file ends inside a global's name")
        self.module, self.name = module, name
        self.opcode, self.pos = "GLOBAL", 0


_LENGTH_WIDTHS = {
    pickletools.TAKEN_FROM_ARGUMENT1: (1, False),
    pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
    pickletools.TAKEN_FROM_ARGUMENT4U: (4, False),
    pickletools.TAKEN_FROM_ARGUMENT8U: (8, False),
}
_VALUED = frozenset({"BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "PROTO"})


def read_opcodes(stream: Any) -> Iterator[tuple[pickletools.OpcodeInfo, Any, int]]:
    """``(opcode, argument, position)`` as the C unpickler reads them, up to STOP.

    Not ``pickletools.genops``: it parses a protocol 0 argument more strictly than the
    unpickler does (``I0x1`` is an int to ``pickle.load``, an error to genops), and a walk
    that stops there would miss the imports after it. Only the arguments the walk uses are
    decoded: strings, memo indices, and a GLOBAL's module and name.

    Args:
        stream: a binary stream at the pickle's first opcode.

    Returns:
        An iterator of ``(opcode, argument, position)``; the argument is None where the
        walk does not use it.

    Raises:
        CutGlobal: the stream ends inside a GLOBAL's or an INST's lines.
        ValueError: an unknown opcode, a malformed argument, or the end before STOP.

    Example:
        >>> import io, pickle
        >>> [(op.name, arg) for op, arg, _ in read_opcodes(io.BytesIO(pickle.dumps("x", 2)))]
        [('PROTO', 2), ('BINUNICODE', 'x'), ('BINPUT', 0), ('STOP', None)]
    """
    while True:
        pos = stream.tell()
        code = stream.read(1)
        if not code:
            raise ValueError("pickle exhausted before seeing STOP")
        op = pickletools.code2op.get(code.decode("latin-1"))
        if op is None:
            raise ValueError(f"at position {pos}, opcode {code!r} unknown")
        try:
            argument = _argument(stream, op)
        except CutGlobal as e:
            e.opcode, e.pos = op.name, pos
            raise
        yield op, argument, pos
        if op.name == "STOP":
            return


def _argument(stream: Any, op: pickletools.OpcodeInfo) -> Any:
    if op.arg is None:
        return None
    n, name = op.arg.n, op.name
    if n == pickletools.UP_TO_NEWLINE:
        if name in ("GLOBAL", "INST"):
            # pickle decodes a GLOBAL's lines as UTF-8, an INST's as ASCII (C and Python alike).
            return _global_lines(stream, "utf-8" if name == "GLOBAL" else "ascii")
        line = _line(stream)
        if name == "UNICODE":
            return line.decode("raw-unicode-escape")
        if name == "STRING":
            return _string_literal(line)
        if name in ("GET", "PUT"):
            return int(line)
        return None  # ints, longs, floats and persistent ids: not needed
    if n in _LENGTH_WIDTHS:
        width, signed = _LENGTH_WIDTHS[n]
        length = int.from_bytes(_exactly(stream, width), "little", signed=signed)
        if length < 0:
            raise ValueError(f"{name} declares a negative length")
        data = _exactly(stream, length)
        if name in STRINGS:
            return data.decode("utf-8", "surrogatepass") if "UNICODE" in name else data
        return None
    data = _exactly(stream, n)
    return int.from_bytes(data, "little") if name in _VALUED else None


def _global_lines(stream: Any, encoding: str) -> tuple[str, str]:
    module, attr = stream.readline(), stream.readline()
    names = module[:-1].decode(encoding), attr[:-1].decode(encoding)
    if not (module.endswith(b"\n") and attr.endswith(b"\n")):
        # The file ends inside them. pickle's reader stops there; torch's weights-only
        # reader takes each line less its last byte, and names that global as it refuses it.
        raise CutGlobal(*names)
    return names


def _line(stream: Any) -> bytes:
    line = stream.readline()
    if not line.endswith(b"\n"):
        raise ValueError("no newline found when trying to read an argument")
    return line[:-1]


def _exactly(stream: Any, n: int) -> bytes:
    if n > sys.maxsize:  # (a declared 8-byte length no read can even be asked for)
        raise ValueError(f"expected {n} bytes, more than any file holds")
    data = stream.read(n)
    if len(data) != n:
        raise ValueError(f"expected {n} bytes, but only {len(data)} remain")
    return data


def _string_literal(line: bytes) -> bytes:
    """A STRING opcode's argument as pickle reads it: one pair of matching quotes stripped,
    then its escapes decoded (``'\\x6fs'`` is ``os``)."""
    if len(line) < 2 or line[:1] != line[-1:] or line[:1] not in (b"'", b'"'):
        raise ValueError("the STRING opcode argument must be quoted")
    return codecs.escape_decode(line[1:-1])[0]  # a bad \x escape: ValueError, as in pickle
