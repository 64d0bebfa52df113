"""safetensors mutations: offsets, dtypes, shapes, the JSON header and its length, the body."""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable
from typing import Any

from .draw import Draw

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
    if (
        isinstance(obj, list)
        and all(isinstance(p, list) and len(p) == 2 for p in obj)
        and obj
        and (isinstance(obj[0][0], str))
    ):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in obj) + "}"
    if isinstance(obj, list):
        return "[" + ",".join(_dumps(v) for v in obj) + "]"
    return json.dumps(obj)


def _st_join(
    pairs: list[list[Any]], body: bytes, d: Draw | None = None, raw: str | None = None
) -> bytes:
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
        (
            "overlap",
            "gap",
            "float",
            "fraction",
            "string",
            "null",
            "negative",
            "reversed",
            "beyond",
            "huge",
            "three",
            "swap",
            "shift_all",
            "bool",
        )
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


def _on_a_tensor(
    edit: Callable[[list[list[Any]], list[Any], Draw, list[str]], None],
) -> Callable[[bytes, Draw, list[str]], bytes | None]:
    """A mutation of one tensor entry drawn from the header (``edit(pairs, entry, d, names)``
    changes it in place), the file joined again after; no input without tensors."""

    @functools.wraps(edit)
    def mutate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
        split = _st_split(data)
        if split is None or not _tensors(split[0]):
            return None
        pairs, body = split
        edit(pairs, d.choice(_tensors(pairs)), d, names)
        return _st_join(pairs, body, d)

    return mutate


ST_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")
ST_DTYPES += ("BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "f32", "", "F31")


@_on_a_tensor
def s_dtype(pairs: list[list[Any]], t: list[Any], d: Draw, names: list[str]) -> None:
    _set(t, "dtype", d.choice((*ST_DTYPES, 4, None, ["F32"])))
    names.append("st.dtype")


@_on_a_tensor
def s_shape(pairs: list[list[Any]], t: list[Any], d: Draw, names: list[str]) -> None:
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
        shape = [0, *shape]
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
        (
            n + 1,
            n - 1,
            n + 8,
            n - 8,
            0,
            1,
            len(data),
            len(data) - 8,
            len(data) + 1,
            2**32,
            2**63,
            2**64 - 1,
            100000001,
            n + 64,
        )
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
        (
            "trailing_comma",
            "garbage",
            "bom",
            "non_utf8",
            "nan",
            "exponent",
            "leading_zero",
            "nul",
            "not_object",
            "empty",
        )
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


@_on_a_tensor
def s_duplicate_key(pairs: list[list[Any]], t: list[Any], d: Draw, names: list[str]) -> None:
    twin = [t[0], [list(x) for x in t[1]]]
    off = _entry(twin).get("data_offsets")
    if isinstance(off, list) and len(off) == 2 and d.bool():
        _set(twin, "data_offsets", [0, off[1] - off[0]])
    pairs.insert(d.choice((0, len(pairs))), twin)
    names.append("st.duplicate_key")


@_on_a_tensor
def s_fields(pairs: list[list[Any]], t: list[Any], d: Draw, names: list[str]) -> None:
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
