"""Pickle mutations, on op lists (:mod:`fuzzkit.pickleops`): ints, strings, globals, payloads,
protocols, nesting, lying lengths. Used inside every pickle-bearing format.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any

from . import pickleops as po
from .draw import Draw
from .seeds import PY_PAYLOAD, SHELL_PAYLOAD

GLOBALS = (
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_tensor",
    "torch._utils _rebuild_parameter",
    "torch._utils _rebuild_parameter_with_state",
    "torch._utils _rebuild_meta_tensor_no_storage",
    "torch._utils _rebuild_wrapper_subclass",
    "torch._utils _rebuild_sparse_tensor",
    "torch._utils _rebuild_qtensor",
    "torch._utils _rebuild_device_tensor_from_numpy",
    "torch._tensor _rebuild_from_type_v2",
    "torch FloatStorage",
    "torch HalfStorage",
    "torch DoubleStorage",
    "torch LongStorage",
    "torch IntStorage",
    "torch ByteStorage",
    "torch BoolStorage",
    "torch BFloat16Storage",
    "torch ComplexFloatStorage",
    "torch UntypedStorage",
    "torch.storage UntypedStorage",
    "torch.storage TypedStorage",
    "torch Size",
    "torch device",
    "torch float32",
    "torch.nn.parameter Parameter",
    "collections OrderedDict",
    "collections defaultdict",
    "collections Counter",
    "builtins set",
    "builtins frozenset",
    "builtins getattr",
    "builtins eval",
    "builtins exec",
    "builtins __import__",
    "__builtin__ set",
    "__builtin__ eval",
    "copy_reg _reconstructor",
    "copyreg _reconstructor",
    "posix system",
    "os system",
    "nt system",
    "subprocess check_output",
    "numpy.core.multiarray _reconstruct",
    "numpy dtype",
    "torch.nn.modules.linear Linear",
    "__main__ Evil",
    "torch.serialization _get_layout",
    "_codecs encode",
)
STRINGS = (
    "cpu",
    "cuda",
    "cuda:0",
    "cuda:1",
    "meta",
    "mps",
    "xla:0",
    "CUDA:1",
    "cuda:-1",
    "",
    "0",
    "1",
    "99",
    "../0",
    "/etc/passwd",
    "data/0",
    "storage",
    "module.",
    "module.fc.weight",
    "a" * 300,
    "\x00",
    "ü",
    "FloatStorage",
    "HalfStorage",
    "ByteStorage",
    "Float8_e4m3fnStorage",
    "BFloat16Storage",
    "ComplexDoubleStorage",
)
PAYLOAD_CALLS = (
    ("posix system", SHELL_PAYLOAD),
    ("os system", SHELL_PAYLOAD),
    ("builtins exec", PY_PAYLOAD),
    ("__builtin__ eval", f"exec({PY_PAYLOAD!r})"),
    ("builtins eval", f"exec({PY_PAYLOAD!r})"),
)
INSERTABLE = (
    "MARK",
    "POP",
    "POP_MARK",
    "DUP",
    "EMPTY_DICT",
    "EMPTY_LIST",
    "EMPTY_TUPLE",
    "NONE",
    "NEWTRUE",
    "STOP",
    "BINPERSID",
    "REDUCE",
    "BUILD",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "SETITEM",
    "SETITEMS",
    "APPEND",
    "APPENDS",
    "MEMOIZE",
    "EMPTY_SET",
    "ADDITEMS",
    "FROZENSET",
    "NEWOBJ",
    "OBJ",
    "STACK_GLOBAL",
)


# ---------------------------------------------------------------------------------------------
# Pickles, as op lists


def _body(ops: list[list[Any]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """(PROTO/FRAME head, the rest without STOP)."""
    head = [o for o in ops[:2] if o[0] in ("PROTO", "FRAME")]
    rest = [o for o in ops[len(head) :] if o[0] != "FRAME"]
    if rest and rest[-1][0] == "STOP":
        rest = rest[:-1]
    return head, rest


def _payload_ops(d: Draw) -> list[list[Any]]:
    """Ops that push the result of calling a dangerous global (REDUCE, INST, OBJ or NEWOBJ)."""
    qualname, arg = d.choice(PAYLOAD_CALLS)
    style = d.choice(("reduce", "reduce", "inst", "obj", "stack_global"))
    if style == "inst":
        return [po.op("MARK"), po.op("BINUNICODE", arg), po.op("INST", qualname)]
    if style == "obj":
        return [po.op("MARK"), po.op("GLOBAL", qualname), po.op("BINUNICODE", arg), po.op("OBJ")]
    if style == "stack_global":
        module, name = qualname.split(" ")
        return [
            po.op("BINUNICODE", module),
            po.op("BINUNICODE", name),
            po.op("STACK_GLOBAL"),
            po.op("BINUNICODE", arg),
            po.op("TUPLE1"),
            po.op("REDUCE"),
        ]
    return [
        po.op("GLOBAL", qualname),
        po.op("BINUNICODE", arg),
        po.op("TUPLE1"),
        po.op("REDUCE"),
    ]


OpsMutator = Callable[[list[list[Any]], Draw], list[list[Any]] | None]


def _on_an_op(
    wanted: Callable[[list[Any]], bool],
) -> Callable[[Callable[[list[Any], Draw], list[Any]]], OpsMutator]:
    """A mutation of one op drawn from those ``wanted`` picks: ``edit(op, d)`` returns the op
    that replaces it; no input without such an op."""

    def wrap(edit: Callable[[list[Any], Draw], list[Any]]) -> OpsMutator:
        @functools.wraps(edit)
        def mutate(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
            found = [i for i, o in enumerate(ops) if wanted(o)]
            if not found:
                return None
            i = d.choice(found)
            ops[i] = edit(ops[i], d)
            return ops

        return mutate

    return wrap


@_on_an_op(lambda o: o[0] in po.INT_OPS and isinstance(o[1], int))
def p_int(op: list[Any], d: Draw) -> list[Any]:
    value = d.interesting_int(int(op[1]))
    name = op[0] if op[0] in ("INT", "LONG", "LONG4") else po.best_int(value)[0]
    return po.op(name, value)


@_on_an_op(lambda o: o[0] in po.MEMO_OPS)
def p_memo(op: list[Any], d: Draw) -> list[Any]:
    value = d.choice((0, 1, 2, int(op[1]) + 1, 255, 2**31 - 1))
    name = op[0]
    if name in ("BINPUT", "BINGET") and value > 255:
        name = "LONG_" + name
    return po.op(name, value)


@_on_an_op(lambda o: o[0] in po.STR_OPS)
def p_str(op: list[Any], d: Draw) -> list[Any]:
    old = str(op[1])
    if old and d.bool(30):
        at = d.int(0, len(old) - 1)
        new = old[:at] + d.choice(("x", ".", "/", "\x00", "", old[at] * 2, "é")) + old[at + 1 :]
    else:
        new = d.choice(STRINGS)
    return po.op(op[0], new)


@_on_an_op(lambda o: o[0] in ("GLOBAL", "INST"))
def p_global(op: list[Any], d: Draw) -> list[Any]:
    return po.op(op[0], d.choice(GLOBALS))


def p_delete(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    if len(ops) < 3:
        return None
    del ops[d.int(1, len(ops) - 2)]
    return ops


def p_duplicate(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    if len(ops) < 3:
        return None
    i = d.int(1, len(ops) - 2)
    ops.insert(i, list(ops[i]))
    return ops


def p_swap(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    if len(ops) < 4:
        return None
    i = d.int(1, len(ops) - 3)
    ops[i], ops[i + 1] = ops[i + 1], ops[i]
    return ops


def p_insert(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    name = d.choice(INSERTABLE)
    ops.insert(d.int(1, max(1, len(ops) - 1)), po.op(name))
    return ops


def p_payload(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    """A call to a dangerous global: as a new entry of the root dict, unreachable, or anywhere."""
    head, rest = _body(ops)
    payload = _payload_ops(d)
    where = d.choice(("entry", "entry", "popped", "anywhere", "storage_type", "build"))
    if where == "entry":
        tail = [po.op("BINUNICODE", d.choice(("zz", "module.evil", "0"))), *payload]
        rest = [*rest, *tail, po.op("SETITEM")]
    elif where == "popped":
        rest = [*payload, po.op("POP"), *rest]
    elif where == "storage_type":
        found = [i for i, o in enumerate(rest) if o[0] == "GLOBAL" and "Storage" in str(o[1])]
        if not found:
            return None
        i = d.choice(found)
        rest = rest[:i] + payload + rest[i + 1 :]
    elif where == "build":
        rest = rest + payload + [po.op("BUILD")]
    else:
        i = d.int(0, len(rest))
        rest = rest[:i] + payload + rest[i:]
    return head + rest + [po.op("STOP")]


def p_proto(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    value = d.choice((0, 1, 2, 3, 4, 5, 6, 255))
    if ops and ops[0][0] == "PROTO":
        if d.bool(20):
            return ops[1:]
        ops[0] = po.op("PROTO", value)
        return ops
    return [po.op("PROTO", value), *ops]


def p_upgrade(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    """Re-encode with protocol-4/5 opcodes: MEMOIZE, SHORT_BINUNICODE, one FRAME."""
    _head, rest = _body(ops)
    out = []
    memo = 0
    for o in rest:
        if o[0] in ("BINPUT", "LONG_BINPUT", "PUT") and int(o[1]) == memo:
            out.append(po.op("MEMOIZE"))
            memo += 1
            continue
        if o[0] in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo = int(o[1]) + 1
        if o[0] == "MEMOIZE":
            memo += 1
        if o[0] in ("BINUNICODE", "UNICODE") and len(str(o[1]).encode("utf-8", "replace")) < 256:
            out.append(po.op("SHORT_BINUNICODE", o[1]))
            continue
        out.append(o)
    body = po.assemble([*out, po.op("STOP")])
    proto = d.choice((4, 5))
    framed = d.bool(70)
    raw = po.encode("PROTO", proto)
    if framed:
        raw += po.encode("FRAME", len(body))
    return [["PROTO", proto, raw + body]]  # already bytes: one pseudo-op


def p_nest(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    """The root inside N nested lists (or dicts, or tuples)."""
    head, rest = _body(ops)
    depth = d.choice((100, 1000, 5000, 10000))
    style = d.choice(("list", "dict", "tuple"))
    if style == "list":
        pre, post = [po.op("EMPTY_LIST")] * depth, [po.op("APPEND")] * depth
    elif style == "dict":
        pre = [po.op("EMPTY_DICT"), po.op("SHORT_BINUNICODE", "k")] * depth
        post = [po.op("SETITEM")] * depth
    else:
        pre, post = [], [po.op("TUPLE1")] * depth
    return head + pre + rest + post + [po.op("STOP")]


def p_bomb(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    """A shared-reference bomb (2**K leaves in K ops) as a new root entry."""
    head, rest = _body(ops)
    k = d.choice((30, 60, 200))
    pair = d.choice(("tuple", "list"))
    bomb = [po.op("NONE")]
    memo = 999_999
    for _ in range(k):
        if pair == "tuple":
            bomb += [po.op("DUP"), po.op("TUPLE2")]
        else:
            get = po.op("LONG_BINGET", memo)
            bomb += [po.op("LONG_BINPUT", memo), po.op("POP"), po.op("EMPTY_LIST")]
            bomb += [get, po.op("APPEND"), list(get), po.op("APPEND")]
    entry = [po.op("BINUNICODE", "bomb"), *bomb, po.op("SETITEM")]
    return head + rest + entry + [po.op("STOP")]


def p_bigvalue(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    """A huge int or a long string as a new root entry."""
    head, rest = _body(ops)
    if d.bool():
        value = po.op("LONG4", 7 ** d.choice((6000, 30000)))
    else:
        value = po.op("BINUNICODE", "x" * d.choice((5000, 40000)))
    entry = [po.op("BINUNICODE", "big"), value, po.op("SETITEM")]
    return head + rest + entry + [po.op("STOP")]


def p_length_lie(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    """A string or bytes op whose length prefix is larger than what follows."""
    found = [
        i
        for i, o in enumerate(ops)
        if o[0] in ("BINUNICODE", "BINBYTES", "SHORT_BINUNICODE", "BINUNICODE8")
    ]
    if not found:
        return None
    i = d.choice(found)
    raw = po.encode(ops[i][0], ops[i][1])
    fmt = {"BINUNICODE": "<I", "BINBYTES": "<I", "SHORT_BINUNICODE": "<B", "BINUNICODE8": "<Q"}
    size = struct.calcsize(fmt[ops[i][0]])
    limit = (1 << (8 * size)) - 1
    lie = min(limit, d.choice((2**31 - 1, 2**32 - 1, 2**40, 255, 1000, 2**63)))
    ops[i] = [ops[i][0], None, raw[:1] + struct.pack(fmt[ops[i][0]], lie) + raw[1 + size :]]
    return ops


PICKLE_OPS: dict[str, Callable[[list[list[Any]], Draw], list[list[Any]] | None]] = {
    "int": p_int,
    "memo": p_memo,
    "str": p_str,
    "global": p_global,
    "delete": p_delete,
    "duplicate": p_duplicate,
    "swap": p_swap,
    "insert": p_insert,
    "payload": p_payload,
    "proto": p_proto,
    "upgrade": p_upgrade,
    "nest": p_nest,
    "bomb": p_bomb,
    "bigvalue": p_bigvalue,
    "length_lie": p_length_lie,
}
# How often each pickle mutation is chosen (the rest once).
PICKLE_WEIGHTS = {"int": 5, "str": 3, "global": 2, "payload": 3, "delete": 2, "memo": 2}
PICKLE_CHOICES = tuple(n for n in PICKLE_OPS for _ in range(PICKLE_WEIGHTS.get(n, 1)))


def mutate_pickle(data: bytes, d: Draw, names: list[str], family: str) -> bytes | None:
    parsed = po.parse(data)
    if parsed is None:
        return None
    ops, _ = parsed
    which = d.choice(PICKLE_CHOICES)
    new = PICKLE_OPS[which]([list(o) for o in ops], d)
    if new is None:
        return None
    names.append(f"{family}.pickle.{which}")
    try:
        return po.assemble(new)
    except (ValueError, struct.error, OverflowError, UnicodeEncodeError):
        return None
