"""A pickle's opcodes read as the C unpickler reads them, without running any.

Only the arguments an import walk uses are decoded (strings, memo indices, a GLOBAL's module
and name); :mod:`~ckpt_tools.formats.pickle.imports` replays them to name every import.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pickletools
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["PREFETCH", "STRINGS", "CutGlobal", "FramedInput", "read_opcodes"]

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
_VALUED = frozenset({"BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT", "PROTO", "FRAME"})

#: How far the C unpickler peeks ahead in a file that offers ``peek`` (``_pickle.c``'s
#: PREFETCH). A FRAME this long or longer it always reads whole with ``read``.
PREFETCH = 8192 * 16


class FramedInput:
    """A pickle's bytes as the C unpickler takes them from a file, FRAMEs included.

    The C unpickler reads a FRAME whole (``read(n)``) unless its bytes are in its input
    already: a file that offers ``peek`` (a buffered file, as ``open(path, "rb")`` gives)
    may hold a frame shorter than :data:`PREFETCH` in its buffer, and then the frame changes
    nothing. A frame read whole leaves the file at its end: a STOP inside it ends the pickle
    there, yet the next ``pickle.load`` starts at the frame's end; and a read that runs past
    it drops the frame's rest and reads on from its end. Without ``peek`` (``io.BytesIO``,
    an unbuffered file) every frame is read whole.

    Args:
        stream: the file, at the pickle's first opcode.
        served: offsets of FRAME opcodes under :data:`PREFETCH` bytes that a buffered
            loader holds in its buffer (each read on as plain bytes); every other frame is
            read whole.

    Example:
        >>> import io, pickle
        >>> body = b"K\\x07." + pickle.dumps("decoy", 2)  # a STOP, then more inside the frame
        >>> data = b"\\x80\\x04\\x95" + len(body).to_bytes(8, "little") + body + b"N."
        >>> framed = FramedInput(io.BytesIO(data))
        >>> [op.name for op, _, _ in read_opcodes(framed)], framed.tell(), framed.after()
        (['PROTO', 'FRAME', 'BININT1', 'STOP'], 14, 29)
        >>> framed.unsettled
        {2}
    """

    def __init__(self, stream: Any, served: frozenset[int] = frozenset()) -> None:
        self._stream, self._served = stream, served
        self._frame: bytes | None = None  # a frame read whole, and where in it
        self._at = self._start = self._opcode = 0
        self._small: int | None = None  # the frame's FRAME offset, where under PREFETCH
        #: Offsets of the frames under PREFETCH bytes read whole whose rest went unread (a
        #: read ran past them, or the STOP came first): a buffered loader may read on there.
        self.unsettled: set[int] = set()

    def tell(self) -> int:
        """Where the next byte the unpickler takes comes from, as an offset in the stream."""
        if self._frame is not None:
            return self._start + self._at
        return self._stream.tell()  # type: ignore[no-any-return]

    def after(self) -> int:
        """Where the stream stands, and the next ``pickle.load`` starts, once STOP is read."""
        self._note_rest()
        return self._stream.tell()  # type: ignore[no-any-return]

    def opcode(self, pos: int) -> None:
        """Told the offset of each opcode before its argument is read."""
        self._opcode = pos

    def read(self, n: int) -> bytes:
        if self._frame is not None:
            if n <= len(self._frame) - self._at:
                self._at += n
                return self._frame[self._at - n : self._at]
            self._drop()
        return self._stream.read(n)  # type: ignore[no-any-return]

    def readline(self) -> bytes:
        if self._frame is not None:
            newline = self._frame.find(b"\n", self._at)
            if newline >= 0:
                line, self._at = self._frame[self._at : newline + 1], newline + 1
                return line
            self._drop()
        return self._stream.readline()  # type: ignore[no-any-return]

    def frame(self, length: int) -> None:
        """A FRAME opcode (at the last :meth:`opcode` offset) declaring ``length`` bytes."""
        if self._frame is not None and length <= len(self._frame) - self._at:
            return  # in the input already: nothing changes
        self._drop()
        if length < PREFETCH and self._opcode in self._served:
            return
        data = _read_at_most(self._stream, length)
        if len(data) < length:
            raise ValueError("pickle data was truncated (a FRAME runs past the end)")
        self._small = self._opcode if length < PREFETCH else None
        self._frame, self._at, self._start = data, 0, self._stream.tell() - length

    def _drop(self) -> None:
        self._note_rest()
        self._frame = None

    def _note_rest(self) -> None:
        frame = self._frame
        if frame is not None and self._at < len(frame) and self._small is not None:
            self.unsettled.add(self._small)


def _read_at_most(stream: Any, length: int) -> bytes:
    """Up to ``length`` bytes of ``stream``, read in bounded pieces: a FRAME may declare more
    bytes (up to 2**64) than a file holds or a read can ask for. Where the stream can tell
    what it has left, a FRAME that runs past it keeps nothing: the stream is read to its end,
    where the unpickler's read would leave it, and its bytes dropped."""
    left = _bytes_left(stream)
    if left is not None and length > left:
        while stream.read(1 << 20):
            pass
        return b""
    data = bytearray()
    while len(data) < length:
        piece = stream.read(min(length - len(data), 1 << 20))
        if not piece:
            break
        data += piece
    return bytes(data)


def _bytes_left(stream: Any) -> int | None:
    """The bytes ``stream`` holds past where it stands, where it can tell."""
    left = getattr(stream, "left_in_file", None)
    if left is not None:
        return int(left())
    with contextlib.suppress(OSError, AttributeError, ValueError):
        at = stream.tell()
        end = stream.seek(0, os.SEEK_END)
        stream.seek(at)
        return int(end - at)
    return None


def read_opcodes(stream: Any) -> Iterator[tuple[pickletools.OpcodeInfo, Any, int]]:
    """``(opcode, argument, position)`` as the C unpickler reads them, up to STOP.

    Not ``pickletools.genops``: it parses a protocol 0 argument more strictly than the
    unpickler does (``I0x1`` is an int to ``pickle.load``, an error to genops), and a walk
    that stops there would miss the imports after it. Only the arguments the walk uses are
    decoded: strings, memo indices, and a GLOBAL's module and name.

    Args:
        stream: a binary stream at the pickle's first opcode; a :class:`FramedInput` is
            read with its FRAMEs as the C unpickler reads them, any other stream as plain
            bytes.

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
        if isinstance(stream, FramedInput):
            stream.opcode(pos)
        try:
            argument = _argument(stream, op)
        except CutGlobal as e:
            e.opcode, e.pos = op.name, pos
            raise
        if op.name == "FRAME" and isinstance(stream, FramedInput):
            stream.frame(argument)
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
            # The C unpickler parses the line as a C string: it ends at a NUL ("0\x00" is 0).
            return int(line.split(b"\0", 1)[0])
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
