"""Structure-aware mutators for torch zips, legacy pickles, tar files, safetensors and pickles.

Each mutator takes the file's bytes and a :class:`~fuzzkit.draw.Draw` and returns new bytes,
or None when it does not apply (the driver then falls back to a byte-level mutator). Names
are ``<family>.<what>``; :data:`FORMAT_DECISIONS` lists those that change which bytes a reader
takes as the file (prepended bytes, duplicate entries, ...), which the oracle reports as
issue-9 class 1 rather than class 7.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
from collections.abc import Callable
from typing import Any

from . import pickleops as po
from . import zipfmt
from .draw import Draw
from .seeds import PY_PAYLOAD, SHELL_PAYLOAD, Seed, kind_of

Mutator = Callable[[bytes, Draw], "bytes | None"]

FORMAT_DECISIONS = frozenset(
    {
        "zip.prefix",
        "zip.duplicate",
        "zip.comment",
        "zip.local_name",
        "zip.method_lie",
        "zip.eocd",
        "zip.reorder",
        "tar.duplicate",
        "st.duplicate_key",
        "legacy.prefix",
        "any.splice",
    }
)

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


def p_int(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    found = [i for i, o in enumerate(ops) if o[0] in po.INT_OPS and isinstance(o[1], int)]
    if not found:
        return None
    i = d.choice(found)
    value = d.interesting_int(int(ops[i][1]))
    name = ops[i][0] if ops[i][0] in ("INT", "LONG", "LONG4") else po.best_int(value)[0]
    ops[i] = po.op(name, value)
    return ops


def p_memo(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    found = [i for i, o in enumerate(ops) if o[0] in po.MEMO_OPS]
    if not found:
        return None
    i = d.choice(found)
    value = d.choice((0, 1, 2, int(ops[i][1]) + 1, 255, 2**31 - 1))
    name = ops[i][0]
    if name in ("BINPUT", "BINGET") and value > 255:
        name = "LONG_" + name
    ops[i] = po.op(name, value)
    return ops


def p_str(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    found = [i for i, o in enumerate(ops) if o[0] in po.STR_OPS]
    if not found:
        return None
    i = d.choice(found)
    old = str(ops[i][1])
    if old and d.bool(30):
        at = d.int(0, len(old) - 1)
        new = old[:at] + d.choice(("x", ".", "/", "\x00", "", old[at] * 2, "é")) + old[at + 1 :]
    else:
        new = d.choice(STRINGS)
    ops[i] = po.op(ops[i][0], new)
    return ops


def p_global(ops: list[list[Any]], d: Draw) -> list[list[Any]] | None:
    found = [i for i, o in enumerate(ops) if o[0] in ("GLOBAL", "INST")]
    if not found:
        return None
    i = d.choice(found)
    ops[i] = po.op(ops[i][0], d.choice(GLOBALS))
    return ops


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
        rest = rest + [*tail, po.op("SETITEM")]
    elif where == "popped":
        rest = payload + [po.op("POP")] + rest
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
    head, rest = _body(ops)
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


# ---------------------------------------------------------------------------------------------
# torch zips


def _zip(data: bytes) -> zipfmt.ZipModel | None:
    return zipfmt.parse_zip(data)


def _build(model: zipfmt.ZipModel, d: Draw, **kwargs: Any) -> bytes:
    return zipfmt.build_zip(model, torch_style=d.bool(80), **kwargs)


def z_pickle(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    entry = model.data_pkl() if model else None
    if model is None or entry is None:
        return None
    new = mutate_pickle(entry.payload(), d, names, "zip")
    if new is None:
        return None
    entry.set_payload(new)
    return _build(model, d)


def z_rename(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or not model.entries:
        return None
    e = d.choice(model.entries)
    how = d.choice(("root", "record", "traversal", "absolute", "case", "strip_root", "backslash"))
    if how == "root":
        e.name = d.choice(("other", "archive", "", "a/b", "..")) + "/" + e.rel
    elif how == "record":
        e.name = e.root + "/" + d.choice(("data/9", "data/0", "data.pkl", "version", "data/00"))
    elif how == "traversal":
        e.name = "../" + e.name
    elif how == "absolute":
        e.name = "/" + e.name
    elif how == "case":
        e.name = e.name.upper()
    elif how == "backslash":
        e.name = e.name.replace("/", "\\")
    else:
        e.name = e.rel
    names.append(f"zip.rename.{how}")
    return _build(model, d)


def z_drop(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or len(model.entries) < 2:
        return None
    e = model.entries.pop(d.index(model.entries))
    names.append("zip.drop." + ("pkl" if e.name.endswith("data.pkl") else "other"))
    return _build(model, d)


def z_duplicate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """A second entry of the same name: first or last, same or other bytes."""
    model = _zip(data)
    if model is None or not model.entries:
        return None
    i = d.index(model.entries)
    original = model.entries[i]
    copy = zipfmt.Entry(original.name, original.raw, original.method, original.crc, original.usize)
    payload = original.payload()
    if original.name.endswith("data.pkl"):
        other = mutate_pickle(payload, d, [], "zip")
        if d.bool(60):
            parsed = po.parse(payload)
            if parsed is not None:
                ops = p_payload([list(o) for o in parsed[0]], d)
                other = po.assemble(ops) if ops else other
        payload = other or payload
    elif d.bool(70):
        payload = payload[::-1] + d.bytes(0, 16)
    copy.set_payload(payload)
    if d.bool():
        model.entries.insert(i + 1, copy)
    else:
        model.entries.append(copy) if d.bool() else model.entries.insert(0, copy)
    names.append("zip.duplicate")
    return _build(model, d)


def z_reorder(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or len(model.entries) < 2:
        return None
    how = d.choice(("reverse", "pkl_last", "rotate", "swap"))
    if how == "reverse":
        model.entries.reverse()
    elif how == "pkl_last":
        pkl = model.data_pkl()
        if pkl is None:
            return None
        model.entries.remove(pkl)
        model.entries.append(pkl)
    elif how == "rotate":
        k = d.int(1, len(model.entries) - 1)
        model.entries = model.entries[k:] + model.entries[:k]
    else:
        i, j = d.index(model.entries), d.index(model.entries)
        model.entries[i], model.entries[j] = model.entries[j], model.entries[i]
    names.append(f"zip.reorder.{how}")
    return _build(model, d)


SIZE_FIELDS = ("csize", "usize", "local_csize", "local_usize", "desc_csize", "desc_usize")
SIZE_FIELDS += ("central_csize", "central_usize")


def z_size(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or not model.entries:
        return None
    e = d.choice(model.entries)
    field = d.choice(SIZE_FIELDS)
    true = len(e.raw) if "csize" in field else e.usize
    e.lies[field] = d.interesting_int(true) & 0xFFFFFFFF
    names.append(f"zip.size.{field}")
    return _build(model, d)


def z_crc(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or not model.entries:
        return None
    e = d.choice(model.entries)
    bad = (e.crc ^ (1 << d.int(0, 31))) & 0xFFFFFFFF
    for field in d.choice((("crc",), ("central_crc",), ("local_crc", "desc_crc"))):
        e.lies[field] = bad
    names.append("zip.crc")
    return _build(model, d)


def z_deflate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or not model.entries:
        return None
    every = d.bool()
    for e in model.entries:
        if every or d.bool():
            e.set_payload(e.payload(), method=8, level=d.choice((0, 1, 6, 9)))
    names.append("zip.deflate")
    return _build(model, d)


def z_method_lie(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or not model.entries:
        return None
    e = d.choice(model.entries)
    e.lies[d.choice(("local_method", "central_method"))] = d.choice((8, 0, 12, 14, 99))
    names.append("zip.method_lie")
    return _build(model, d)


def z_local_name(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None or not model.entries:
        return None
    e = d.choice(model.entries)
    other = d.choice(model.entries).name
    e.lies["local_name"] = (other if other != e.name else e.name + "x").encode()
    names.append("zip.local_name")
    return _build(model, d)


def z_storage(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """A storage record longer or shorter than the pickle declares."""
    model = _zip(data)
    if model is None:
        return None
    records = [e for e in model.entries if "/data/" in "/" + e.rel]
    if not records:
        return None
    e = d.choice(records)
    payload = e.payload()
    how = d.choice(("longer", "shorter", "empty", "double"))
    if how == "longer":
        payload += d.bytes(1, 64)
    elif how == "shorter":
        payload = payload[: d.int(0, max(0, len(payload) - 1))]
    elif how == "empty":
        payload = b""
    else:
        payload = payload * 2
    e.set_payload(payload)
    names.append(f"zip.storage.{how}")
    return _build(model, d)


def z_small_records(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None:
        return None
    small = [e for e in model.entries if e.rel in ("version", ".format_version", "byteorder")]
    small += [e for e in model.entries if e.rel == ".storage_alignment"]
    if not small:
        return None
    e = d.choice(small)
    e.set_payload(d.choice((b"", b"1", b"2", b"3\n", b"99", b"abc", b"big", b"-1", b"6\n" * 500)))
    names.append(f"zip.record.{e.rel}")
    return _build(model, d)


def z_eocd(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None:
        return None
    field = d.choice(("count", "cd_size", "cd_offset"))
    lie = d.interesting_int(len(model.entries) if field == "count" else 100) & 0xFFFFFFFF
    names.append(f"zip.eocd.{field}")
    return _build(model, d, eocd_lies={field: lie})


def z_prefix(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """Bytes in front: junk, a plain pickle, a whole legacy checkpoint, a payload pickle."""
    from .seeds import built_seeds

    model = _zip(data)
    if model is None:
        return None
    how = d.choice(("junk", "pickle", "legacy", "evil_pickle", "zip_magic"))
    if how == "junk":
        prefix = d.bytes(1, 64)
    elif how == "pickle":
        prefix = pickle.dumps({"a": 1}, protocol=2)
    elif how == "legacy":
        prefix = next(s.data for s in built_seeds() if s.kind == "legacy")
    elif how == "evil_pickle":
        prefix = next(s.data for s in built_seeds() if s.name == "pickle-evil")
    else:
        prefix = b"PK\x03\x04" + d.bytes(0, 40)
    model.prefix = prefix
    names.append(f"zip.prefix.{how}")
    return _build(model, d, fix_offsets=d.bool())


def z_comment(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None:
        return None
    if d.bool():
        model.comment = d.bytes(1, 100)
    else:  # a second end-of-central-directory record inside the comment
        model.comment = zipfmt.EOCD + struct.pack("<4HIIH", 0, 0, 0, 0, 0, 0, 0)
    names.append("zip.comment")
    return _build(model, d)


def z_style(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    model = _zip(data)
    if model is None:
        return None
    names.append("zip.rebuild")
    return zipfmt.build_zip(model, torch_style=d.bool(), align=d.choice((64, 0, 1, 4096)))


ZIP_MUTATORS: dict[str, Callable[[bytes, Draw, list[str]], bytes | None]] = {
    "pickle": z_pickle,
    "rename": z_rename,
    "drop": z_drop,
    "duplicate": z_duplicate,
    "reorder": z_reorder,
    "size": z_size,
    "crc": z_crc,
    "deflate": z_deflate,
    "method_lie": z_method_lie,
    "local_name": z_local_name,
    "storage": z_storage,
    "records": z_small_records,
    "eocd": z_eocd,
    "prefix": z_prefix,
    "comment": z_comment,
    "style": z_style,
}
ZIP_WEIGHTS = {"pickle": 8, "storage": 2, "size": 2, "duplicate": 2, "prefix": 2, "deflate": 2}


# ---------------------------------------------------------------------------------------------
# Legacy (pre-1.6) files: five pickles, then the storages


def _legacy_split(data: bytes) -> tuple[list[bytes], bytes] | None:
    pickles, at = [], 0
    for _ in range(5):
        parsed = po.parse(data, at)
        if parsed is None:
            return None
        pickles.append(data[at : parsed[1]])
        at = parsed[1]
    return pickles, data[at:]


def l_pickle(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _legacy_split(data)
    if split is None:
        return None
    pickles, tail = split
    which = d.choice((3, 3, 3, 3, 0, 1, 2, 4))
    new = mutate_pickle(pickles[which], d, names, f"legacy.p{which}")
    if new is None:
        return None
    pickles[which] = new
    return b"".join(pickles) + tail


def l_header(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _legacy_split(data)
    if split is None:
        return None
    pickles, tail = split
    which = d.choice(("magic", "version", "sys_info", "keys"))
    if which == "magic":
        pickles[0] = pickle.dumps(d.choice((0x1950A86A20F9469CFC6C + 1, 0, 119547037146038801333356)), 2)
    elif which == "version":
        pickles[1] = pickle.dumps(d.choice((1000, 1002, 0, -1, "1001")), 2)
    elif which == "sys_info":
        info = {"protocol_version": 1001, "little_endian": True}
        info["type_sizes"] = {"short": 2, "int": 4, "long": 8}
        change = d.choice(("big_endian", "long4", "missing", "not_a_dict"))
        if change == "big_endian":
            info["little_endian"] = False
        elif change == "long4":
            info["type_sizes"]["long"] = 4
        elif change == "missing":
            del info["type_sizes"]
        pickles[2] = pickle.dumps(info if change != "not_a_dict" else [1], 2)
    else:
        keys = _restricted_loads(pickles[4])
        if not isinstance(keys, list) or not keys:
            return None
        change = d.choice(("drop", "dup", "reverse", "rename", "extra"))
        if change == "drop":
            keys.pop(d.index(keys))
        elif change == "dup":
            keys.append(keys[0])
        elif change == "reverse":
            keys.reverse()
        elif change == "rename":
            keys[d.index(keys)] = d.choice(("99", "x", "0"))
        else:
            keys.append("extra")
        pickles[4] = pickle.dumps(keys, 2)
        which = f"keys.{change}"
    names.append(f"legacy.header.{which}")
    return b"".join(pickles) + tail


def _restricted_loads(data: bytes) -> Any:
    class NoGlobals(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            raise pickle.UnpicklingError("no globals")

    try:
        return NoGlobals(io.BytesIO(data)).load()
    except Exception:
        return None


def l_tail(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """Storage counts that lie, storages cut short or followed by more bytes."""
    split = _legacy_split(data)
    if split is None or len(split[1]) < 8:
        return None
    pickles, tail = split
    how = d.choice(("count", "count", "truncate", "append", "zero_count"))
    if how in ("count", "zero_count"):
        (count,) = struct.unpack_from("<q", tail)
        new = 0 if how == "zero_count" else d.interesting_int(count)
        new = max(-(2**63), min(2**63 - 1, new))
        tail = struct.pack("<q", new) + tail[8:]
    elif how == "truncate":
        tail = tail[: d.int(0, len(tail) - 1)]
    else:
        tail += d.bytes(1, 32)
    names.append(f"legacy.tail.{how}")
    return b"".join(pickles) + tail


LEGACY_MUTATORS = {"pickle": l_pickle, "header": l_header, "tail": l_tail}
LEGACY_WEIGHTS = {"pickle": 5, "tail": 2}


# ---------------------------------------------------------------------------------------------
# torch's tar format


def _tar_members(data: bytes) -> list[tuple[tarfile.TarInfo, bytes]] | None:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = []
            for info in tar.getmembers():
                f = tar.extractfile(info) if info.isfile() else None
                members.append((info, f.read() if f else b""))
            return members
    except (tarfile.TarError, OSError, EOFError, ValueError):
        return None


def _tar_build(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for info, payload in members:
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload) if info.isfile() else None)
    return out.getvalue()


def t_pickle(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    members = _tar_members(data)
    if not members:
        return None
    named = {info.name: i for i, (info, _) in enumerate(members)}
    choice = d.choice(("pickle", "pickle", "pickle", "storages", "tensors", "sys_info"))
    if choice not in named:
        return None
    i = named[choice]
    new = mutate_pickle(members[i][1], d, names, f"tar.{choice}")
    if new is None:
        return None
    # Members holding a pickle followed by binary records keep their tail.
    parsed = po.parse(members[i][1])
    tail = members[i][1][parsed[1] :] if parsed else b""
    members[i] = (members[i][0], new + tail)
    return _tar_build(members)


def _tensor_records(payload: bytes) -> list[tuple[int, int]] | None:
    """(offset, ndim) of each binary record in the ``tensors`` member."""
    parsed = po.parse(payload)
    if parsed is None:
        return None
    count = _restricted_loads(payload[: parsed[1]])
    at, found = parsed[1], []
    for _ in range(count if isinstance(count, int) and 0 <= count < 10000 else 0):
        header = po.parse(payload, at)
        if header is None or header[1] + 8 > len(payload):
            return found
        at = header[1]
        (ndim,) = struct.unpack_from("<i", payload, at)
        if not 0 <= ndim < 64:
            return found
        found.append((at, ndim))
        at += 8 + 16 * ndim + 8
    return found


def t_binary(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """Shapes, strides, offsets and ndim of the ``tensors`` member; counts of ``storages``."""
    members = _tar_members(data)
    if not members:
        return None
    named = {info.name: i for i, (info, _) in enumerate(members)}
    if "tensors" not in named:
        return None
    i = named["tensors"]
    payload = bytearray(members[i][1])
    records = _tensor_records(bytes(payload))
    if not records:
        return None
    at, ndim = d.choice(records)
    field = d.choice(("ndim", "shape", "stride", "offset"))
    if field == "ndim":
        struct.pack_into("<i", payload, at, d.choice((ndim + 1, ndim - 1, 0, 1 << 20, -1)))
    else:
        if field != "offset" and ndim == 0:
            return None
        base = {"shape": 8, "stride": 8 + 8 * ndim, "offset": 8 + 16 * ndim}[field]
        where = at + base + (8 * d.int(0, ndim - 1) if field != "offset" else 0)
        (old,) = struct.unpack_from("<q", payload, where)
        new = max(-(2**63), min(2**63 - 1, d.interesting_int(old)))
        struct.pack_into("<q", payload, where, new)
    members[i] = (members[i][0], bytes(payload))
    names.append(f"tar.tensors.{field}")
    return _tar_build(members)


def t_storage_count(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    members = _tar_members(data)
    if not members:
        return None
    named = {info.name: i for i, (info, _) in enumerate(members)}
    if "storages" not in named:
        return None
    i = named["storages"]
    payload = bytearray(members[i][1])
    first = po.parse(bytes(payload))
    second = po.parse(bytes(payload), first[1]) if first else None
    if second is None or second[1] + 8 > len(payload):
        return None
    (old,) = struct.unpack_from("<q", payload, second[1])
    struct.pack_into("<q", payload, second[1], max(-(2**63), min(2**63 - 1, d.interesting_int(old))))
    members[i] = (members[i][0], bytes(payload))
    names.append("tar.storages.count")
    return _tar_build(members)


def t_members(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    members = _tar_members(data)
    if not members:
        return None
    how = d.choice(("drop", "duplicate", "reverse", "rename", "symlink", "directory"))
    i = d.index(members)
    info, payload = members[i]
    if how == "drop":
        members.pop(i)
    elif how == "duplicate":
        twin = tarfile.TarInfo(info.name)
        twin.mtime, twin.mode = 0, 0o644
        members.insert(d.choice((i + 1, len(members), 0)), (twin, payload[::-1] or b"x"))
        how = "duplicate"
    elif how == "reverse":
        members.reverse()
    elif how == "rename":
        info.name = d.choice(("../" + info.name, "/" + info.name, info.name + "x", "./" + info.name))
    elif how == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, d.choice(("/etc/hostname", "../outside", "pickle"))
        members[i] = (info, b"")
    else:
        info.type = tarfile.DIRTYPE
        members[i] = (info, b"")
    names.append("tar.duplicate" if how == "duplicate" else f"tar.members.{how}")
    return _tar_build(members)


def t_header_size(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """A ustar size field that lies (its checksum fixed or not)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            offsets = [m.offset for m in tar.getmembers()]
    except (tarfile.TarError, OSError):
        return None
    if not offsets:
        return None
    at = d.choice(offsets)
    out = bytearray(data)
    size = d.choice((0, 1, 511, 512, 10**9, 8**11 - 1))
    out[at + 124 : at + 136] = f"{size:011o}".encode()[-11:] + b"\x00"
    if d.bool(70):
        out[at + 148 : at + 156] = b"        "
        checksum = sum(out[at : at + 512])
        out[at + 148 : at + 156] = f"{checksum:06o}\x00 ".encode()
    names.append("tar.header_size")
    return bytes(out)


TAR_MUTATORS = {
    "pickle": t_pickle,
    "binary": t_binary,
    "storage_count": t_storage_count,
    "members": t_members,
    "header_size": t_header_size,
}
TAR_WEIGHTS = {"pickle": 3, "binary": 3}


# ---------------------------------------------------------------------------------------------
# safetensors


def _st_split(data: bytes) -> tuple[list[list[Any]], bytes] | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data)
    if n > len(data) - 8:
        return None
    try:
        pairs = json.loads(data[8 : 8 + n], object_pairs_hook=lambda p: [list(x) for x in p])
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        return None
    return pairs, data[8 + n :]


def _dumps(obj: Any) -> str:
    """JSON for nested pair lists (keeps duplicate keys and their order)."""
    if isinstance(obj, list) and all(isinstance(p, list) and len(p) == 2 for p in obj) and obj and (
        isinstance(obj[0][0], str)
    ):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in obj) + "}"
    if isinstance(obj, list):
        return "[" + ",".join(_dumps(v) for v in obj) + "]"
    return json.dumps(obj)


def _st_join(pairs: list[list[Any]], body: bytes, d: Draw | None = None, raw: str | None = None) -> bytes:
    text = (raw if raw is not None else _dumps(pairs)).encode("utf-8", "surrogatepass")
    if d is None or d.bool(80):
        text += b" " * ((-len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _tensors(pairs: list[list[Any]]) -> list[list[Any]]:
    return [p for p in pairs if p[0] != "__metadata__" and isinstance(p[1], list)]


def _entry(p: list[Any]) -> dict[str, Any]:
    return {k: v for k, v in p[1]} if all(isinstance(x, list) and len(x) == 2 for x in p[1]) else {}


def _set(p: list[Any], key: str, value: Any) -> None:
    for x in p[1]:
        if x[0] == key:
            x[1] = value
            return
    p[1].append([key, value])


def s_offsets(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None:
        return None
    pairs, body = split
    tensors = _tensors(pairs)
    if not tensors:
        return None
    i = d.index(tensors)
    begin, end = (_entry(tensors[i]).get("data_offsets") or [0, 0])[:2]
    how = d.choice(
        ("overlap", "gap", "float", "fraction", "string", "null", "negative", "reversed")
        + ("beyond", "huge", "three", "swap", "shift_all", "bool")
    )
    if how == "overlap" and i > 0:
        prev = _entry(tensors[i - 1]).get("data_offsets", [0, 0])
        new: Any = [prev[0], prev[0] + (end - begin)]
    elif how == "gap":
        new = [begin + 8, end + 8]
    elif how == "float":
        new = [float(begin), float(end)]
    elif how == "fraction":
        new = [begin + 0.5, end]
    elif how == "string":
        new = [str(begin), str(end)]
    elif how == "null":
        new = None
    elif how == "negative":
        new = [-8, end]
    elif how == "reversed":
        new = [end, begin]
    elif how == "beyond":
        new = [begin, len(body) + d.int(1, 4096)]
    elif how == "huge":
        new = [begin, d.choice((2**40, 2**63 - 1, 2**64 - 1, 2**64 + 5, 10**30))]
    elif how == "three":
        new = [begin, end, end]
    elif how == "bool":
        new = [False, True]
    elif how == "swap" and len(tensors) > 1:
        j = d.index(tensors)
        other = _entry(tensors[j]).get("data_offsets")
        _set(tensors[j], "data_offsets", [begin, end])
        new = other
    else:
        for t in tensors:
            off = _entry(t).get("data_offsets")
            if isinstance(off, list) and len(off) == 2:
                _set(t, "data_offsets", [off[0] + 8, off[1] + 8])
        body = b"\x00" * 8 + body
        names.append("st.offsets.shift_all")
        return _st_join(pairs, body, d)
    _set(tensors[i], "data_offsets", new)
    names.append(f"st.offsets.{how}")
    return _st_join(pairs, body, d)


ST_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")
ST_DTYPES += ("BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "f32", "", "F31")


def s_dtype(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None or not _tensors(split[0]):
        return None
    pairs, body = split
    t = d.choice(_tensors(pairs))
    _set(t, "dtype", d.choice((*ST_DTYPES, 4, None, ["F32"])))
    names.append("st.dtype")
    return _st_join(pairs, body, d)


def s_shape(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None or not _tensors(split[0]):
        return None
    pairs, body = split
    t = d.choice(_tensors(pairs))
    shape = _entry(t).get("shape")
    shape = list(shape) if isinstance(shape, list) else []
    how = d.choice(("grow", "shrink", "scalar", "zero", "negative", "float", "string", "huge"))
    how = how if shape or how in ("scalar", "zero", "huge") else "scalar"
    if how == "grow":
        shape.append(2)
    elif how == "shrink":
        shape[-1] = max(0, shape[-1] - 1)
    elif how == "scalar":
        shape = []
    elif how == "zero":
        shape = [0] + shape
    elif how == "negative":
        shape[0] = -shape[0] or -1
    elif how == "float":
        shape[0] = float(shape[0]) + d.choice((0.0, 0.5))
    elif how == "string":
        shape[0] = str(shape[0])
    else:
        shape = d.choice(([2**62, 4], [2**32, 2**32], [2**64], [1] * 100, [2**31, 2**31, 0]))
    _set(t, "shape", shape)
    names.append(f"st.shape.{how}")
    return _st_join(pairs, body, d)


def s_nest(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None:
        return None
    pairs, body = split
    depth = d.choice((100, 1000, 10000, 25000))
    nested = "[" * depth + "]" * depth if d.bool() else '{"a":' * depth + "1" + "}" * depth
    where = d.choice(("metadata", "extra_key", "field"))
    text = _dumps(pairs)
    if where == "metadata":
        raw = '{"__metadata__":{"x":' + nested + "}," + text[1:] if len(text) > 2 else None
    elif where == "extra_key":
        raw = '{"deep":' + nested + "," + text[1:] if len(text) > 2 else None
    else:
        tensors = _tensors(pairs)
        if not tensors:
            return None
        t = d.choice(tensors)
        marker = "__NEST__"
        _set(t, "nest", marker)
        raw = _dumps(pairs).replace(json.dumps(marker), nested)
    if raw is None:
        return None
    names.append(f"st.nest.{where}")
    return _st_join(pairs, body, d, raw=raw)


def s_metadata(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None:
        return None
    pairs, body = split
    pairs = [p for p in pairs if p[0] != "__metadata__"]
    value = d.choice(
        ([["a", 1]], [["a", ["b"]]], "string", None, [1, 2], [["a", "b" * 40000]], [["a", None]])
    )
    pairs.insert(0, ["__metadata__", value])
    names.append("st.metadata")
    return _st_join(pairs, body, d)


def s_header_len(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data)
    lie = d.choice(
        (n + 1, n - 1, n + 8, n - 8, 0, 1, len(data), len(data) - 8, len(data) + 1, 2**32)
        + (2**63, 2**64 - 1, 100_000_001, n + 64)
    )
    names.append("st.header_len")
    return struct.pack("<Q", max(0, min(lie, 2**64 - 1))) + data[8:]


def s_json_text(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None:
        return None
    pairs, body = split
    text = _dumps(pairs)
    how = d.choice(
        ("trailing_comma", "garbage", "bom", "non_utf8", "nan", "exponent", "leading_zero")
        + ("nul", "not_object", "empty")
    )
    if how == "trailing_comma":
        text = text[:-1] + ",}"
    elif how == "garbage":
        text += d.choice(("x", "}", "{}", "\x00"))
    elif how == "bom":
        text = "\ufeff" + text
    elif how == "non_utf8":
        text = text.replace('"', '"\udcff', 1)
    elif how == "nan":
        text = text.replace("[0,", "[NaN,", 1)
    elif how == "exponent":
        text = text.replace("[0,", "[0e0,", 1)
    elif how == "leading_zero":
        text = text.replace("[0,", "[00,", 1)
    elif how == "nul":
        text = text.replace("{", "{\x00", 1)
    elif how == "not_object":
        text = "[" + text + "]"
    else:
        text = "{}"
    names.append(f"st.json.{how}")
    return _st_join(pairs, body, d, raw=text)


def s_duplicate_key(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None or not _tensors(split[0]):
        return None
    pairs, body = split
    t = d.choice(_tensors(pairs))
    twin = [t[0], [list(x) for x in t[1]]]
    off = _entry(twin).get("data_offsets")
    if isinstance(off, list) and len(off) == 2 and d.bool():
        _set(twin, "data_offsets", [0, off[1] - off[0]])
    pairs.insert(d.choice((0, len(pairs))), twin)
    names.append("st.duplicate_key")
    return _st_join(pairs, body, d)


def s_fields(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None or not _tensors(split[0]):
        return None
    pairs, body = split
    t = d.choice(_tensors(pairs))
    how = d.choice(("drop", "extra", "not_object", "rename_key", "empty_key"))
    if how == "drop" and t[1]:
        t[1].pop(d.index(t[1]))
    elif how == "extra":
        t[1].append(["extra", 1])
    elif how == "not_object":
        t[1] = d.choice(([1, 2], "x", None))
    elif how == "rename_key":
        t[0] = d.choice(("../x", "a" * 1000, "x/../y", "__metadata__"))
    else:
        t[0] = ""
    names.append(f"st.fields.{how}")
    return _st_join(pairs, body, d)


def s_body(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    split = _st_split(data)
    if split is None:
        return None
    pairs, body = split
    how = d.choice(("truncate", "append", "empty"))
    if how == "truncate" and body:
        body = body[: d.int(0, len(body) - 1)]
    elif how == "append":
        body += d.bytes(1, 64)
    else:
        body = b""
    names.append(f"st.body.{how}")
    return _st_join(pairs, body, d)


ST_MUTATORS = {
    "offsets": s_offsets,
    "dtype": s_dtype,
    "shape": s_shape,
    "nest": s_nest,
    "metadata": s_metadata,
    "header_len": s_header_len,
    "json_text": s_json_text,
    "duplicate_key": s_duplicate_key,
    "fields": s_fields,
    "body": s_body,
}
ST_WEIGHTS = {"offsets": 4, "dtype": 2, "shape": 2}


# ---------------------------------------------------------------------------------------------
# Bytes, for any file


def g_truncate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    names.append("any.truncate")
    return data[: d.int(0, max(0, len(data) - 1))]


def g_flip(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    if not data:
        return None
    out = bytearray(data)
    for _ in range(d.int(1, 4)):
        out[d.index(out)] ^= 1 << d.int(0, 7)
    names.append("any.flip")
    return bytes(out)


def g_insert(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    at = d.int(0, len(data))
    names.append("any.insert")
    return data[:at] + d.bytes(1, 16) + data[at:]


def g_delete(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    if len(data) < 2:
        return None
    at = d.int(0, len(data) - 1)
    names.append("any.delete")
    return data[:at] + data[at + d.int(1, 64) :]


def g_splice(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    from .seeds import built_seeds

    other = d.choice(built_seeds()).data
    at, cut = d.int(0, len(data)), d.int(0, len(other))
    names.append("any.splice")
    return data[:at] + other[cut:]


def g_append(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    names.append("any.append")
    return data + d.bytes(1, 64)


ANY_MUTATORS = {
    "truncate": g_truncate,
    "flip": g_flip,
    "insert": g_insert,
    "delete": g_delete,
    "splice": g_splice,
    "append": g_append,
}


def _weighted(table: dict[str, Any], weights: dict[str, int]) -> tuple[str, ...]:
    return tuple(n for n in table for _ in range(weights.get(n, 1)))


FAMILIES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "zip": (ZIP_MUTATORS, _weighted(ZIP_MUTATORS, ZIP_WEIGHTS)),
    "torchscript": (ZIP_MUTATORS, _weighted(ZIP_MUTATORS, ZIP_WEIGHTS)),
    "legacy": (LEGACY_MUTATORS, _weighted(LEGACY_MUTATORS, LEGACY_WEIGHTS)),
    "tar": (TAR_MUTATORS, _weighted(TAR_MUTATORS, TAR_WEIGHTS)),
    "safetensors": (ST_MUTATORS, _weighted(ST_MUTATORS, ST_WEIGHTS)),
}


def pickle_file(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    return mutate_pickle(data, d, names, "pickle")


def mutate_once(data: bytes, kind: str, d: Draw, names: list[str]) -> bytes:
    """One mutation: structure-aware for the format (mostly), bytes otherwise."""
    if d.bool(85):
        if kind == "pickle":
            out = pickle_file(data, d, names)
        elif kind in FAMILIES:
            table, choices = FAMILIES[kind]
            out = table[d.choice(choices)](data, d, names)
        else:
            out = None
        if out is not None:
            return out
    while True:
        out = ANY_MUTATORS[d.choice(tuple(ANY_MUTATORS))](data, d, names)
        if out is not None:
            return out


def mutate(seed: Seed, d: Draw, count: int) -> tuple[bytes, list[str]]:
    """``count`` mutations in a row, each chosen for the format the bytes now look like."""
    data, names = seed.data, []
    for i in range(count):
        kind = seed.kind if i == 0 else kind_of(data)
        if kind == "other" and seed.kind in FAMILIES:
            kind = seed.kind
        data = mutate_once(data, kind, d, names)
    return data, names
