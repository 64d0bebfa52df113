"""Pickles as editable opcode lists: parse with pickletools, change args, re-encode.

An op is ``[name, arg, raw]``; ``raw`` is the op's bytes as found (kept for ops we do not
re-encode). :func:`assemble` re-encodes only the ops whose ``raw`` is ``None``.
"""

from __future__ import annotations

import io
import pickletools
import struct
from typing import Any

OPCODES = {op.name: op for op in pickletools.opcodes}
CODE = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}

INT_OPS = {"BININT1", "BININT2", "BININT", "LONG1", "LONG4", "INT", "LONG"}
STR_OPS = {
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}
BYTES_OPS = {"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"}
MEMO_OPS = {"BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "PUT", "GET"}


def parse(data: bytes, start: int = 0) -> tuple[list[list[Any]], int] | None:
    """The ops of the pickle at ``start`` and the offset just past its STOP (None: not a pickle)."""
    f = io.BytesIO(data)
    f.seek(start)
    found: list[tuple[str, Any, int]] = []
    try:
        for opcode, arg, pos in pickletools.genops(f):
            found.append((opcode.name, arg, pos))
    except Exception:
        return None
    if not found or found[-1][0] != "STOP":
        return None
    end = found[-1][2] + 1
    bounds = [pos for _, _, pos in found] + [end]
    ops = [[name, arg, data[bounds[i] : bounds[i + 1]]] for i, (name, arg, _) in enumerate(found)]
    return ops, end


def encode_long(value: int) -> bytes:
    if value == 0:
        return b""
    nbytes = (value.bit_length() >> 3) + 1
    out = value.to_bytes(nbytes, "little", signed=True)
    if value < 0 and nbytes > 1 and out[-1] == 0xFF and (out[-2] & 0x80):
        out = out[:-1]
    return out


def encode(name: str, arg: Any) -> bytes:
    """One op's bytes (``arg`` as pickletools reports it)."""
    code = CODE[name]
    if name in ("BININT1", "BINPUT", "BINGET", "PROTO"):
        return code + struct.pack("<B", arg & 0xFF)
    if name == "BININT2":
        return code + struct.pack("<H", arg & 0xFFFF)
    if name == "BININT":
        return code + struct.pack("<i", ((arg + 2**31) % 2**32) - 2**31)
    if name in ("LONG_BINPUT", "LONG_BINGET"):
        return code + struct.pack("<I", arg & 0xFFFFFFFF)
    if name == "LONG1":
        raw = encode_long(arg)
        return code + struct.pack("<B", len(raw)) + raw
    if name == "LONG4":
        raw = encode_long(arg)
        return code + struct.pack("<i", len(raw)) + raw
    if name == "INT":
        if arg is True or arg is False:
            return code + (b"01\n" if arg else b"00\n")
        return code + str(int(arg)).encode() + b"\n"
    if name == "LONG":
        return code + str(int(arg)).encode() + b"L\n"
    if name in ("PUT", "GET"):
        return code + str(int(arg)).encode() + b"\n"
    if name == "FRAME":
        return code + struct.pack("<Q", arg)
    if name == "BINFLOAT":
        return code + struct.pack(">d", arg)
    if name == "FLOAT":
        return code + repr(float(arg)).encode() + b"\n"
    if name in STR_OPS:
        return _encode_str(name, str(arg))
    if name in BYTES_OPS:
        raw = bytes(arg)
        size = {"SHORT_BINBYTES": "<B", "BINBYTES": "<I", "BINBYTES8": "<Q", "BYTEARRAY8": "<Q"}
        return code + struct.pack(size[name], len(raw)) + raw
    if name in ("GLOBAL", "INST"):
        module, _, qual = str(arg).partition(" ")
        return code + module.encode() + b"\n" + qual.encode() + b"\n"
    if OPCODES[name].arg is None:
        return code
    raise ValueError(f"cannot encode {name}")


def _encode_str(name: str, text: str) -> bytes:
    code = CODE[name]
    if name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"):
        raw = text.encode("utf-8", "surrogatepass")
        if name == "SHORT_BINUNICODE" and len(raw) > 255:
            name, code = "BINUNICODE", CODE["BINUNICODE"]
        fmt = {"BINUNICODE": "<I", "SHORT_BINUNICODE": "<B", "BINUNICODE8": "<Q"}[name]
        return code + struct.pack(fmt, len(raw)) + raw
    if name == "UNICODE":
        return code + text.encode("raw-unicode-escape") + b"\n"
    raw = text.encode("latin-1", "replace")
    if name == "SHORT_BINSTRING":
        if len(raw) > 255:
            return CODE["BINSTRING"] + struct.pack("<i", len(raw)) + raw
        return code + struct.pack("<B", len(raw)) + raw
    if name == "BINSTRING":
        return code + struct.pack("<i", len(raw)) + raw
    return code + repr(raw.decode("latin-1")).encode("latin-1") + b"\n"  # STRING


def best_int(value: int) -> tuple[str, int]:
    """The op a pickler would use for ``value``."""
    if 0 <= value < 256:
        return "BININT1", value
    if 0 <= value < 65536:
        return "BININT2", value
    if -(2**31) <= value < 2**31:
        return "BININT", value
    return "LONG1", value


def op(name: str, arg: Any = None) -> list[Any]:
    return [name, arg, None]


def assemble(ops: list[list[Any]], keep_frames: bool = False) -> bytes:
    """The pickle's bytes. FRAME ops are dropped (they are optional) unless ``keep_frames``."""
    out = []
    for name, arg, raw in ops:
        if name == "FRAME" and not keep_frames:
            continue
        out.append(raw if raw is not None else encode(name, arg))
    return b"".join(out)


def protocol(ops: list[list[Any]]) -> int:
    return int(ops[0][1]) if ops and ops[0][0] == "PROTO" else 0
