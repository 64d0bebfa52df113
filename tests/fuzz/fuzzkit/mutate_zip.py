"""torch zip mutations: the pickle, entries (rename, drop, duplicate, reorder), declared sizes,
CRCs, compression, storages, the end record, prepended bytes.
"""

from __future__ import annotations

import functools
import pickle
import struct
from collections.abc import Callable
from typing import Any

from . import pickleops as po
from . import zipfmt
from .draw import Draw
from .mutate_pickle import mutate_pickle, p_payload

# ---------------------------------------------------------------------------------------------
# torch zips


def _zip(data: bytes) -> zipfmt.ZipModel | None:
    return zipfmt.parse_zip(data)


def _build(model: zipfmt.ZipModel, d: Draw, **kwargs: Any) -> bytes:
    return zipfmt.build_zip(model, torch_style=d.bool(80), **kwargs)


def _on_an_entry(
    edit: Callable[[zipfmt.ZipModel, zipfmt.Entry, Draw, list[str]], None],
) -> Callable[[bytes, Draw, list[str]], bytes | None]:
    """A mutation of one entry drawn from the zip (``edit(model, entry, d, names)`` changes
    it in place), the zip built again after; no input without entries."""

    @functools.wraps(edit)
    def mutate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
        model = _zip(data)
        if model is None or not model.entries:
            return None
        edit(model, d.choice(model.entries), d, names)
        return _build(model, d)

    return mutate


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


@_on_an_entry
def z_rename(model: zipfmt.ZipModel, e: zipfmt.Entry, d: Draw, names: list[str]) -> None:
    how = d.choice(
        (
            "root",
            "record",
            "traversal",
            "absolute",
            "case",
            "record_case",
            "strip_root",
            "backslash",
            "double_slash",
            "dot_segment",
            "not_utf8",
        )
    )
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
    elif how == "record_case":  # torch's lookup ignores case; its folder check does not
        e.name = e.root + "/" + _flip_case(e.rel, d)
    elif how == "backslash":
        e.name = e.name.replace("/", "\\")
    elif how == "double_slash":
        e.name = e.root + "//" + e.rel
    elif how == "dot_segment":
        e.name = e.root + "/./" + e.rel
    elif how == "not_utf8":  # written as the byte 0xff (build_zip encodes surrogateescape)
        e.name = e.name + "\udcff"
    else:
        e.name = e.rel
    names.append(f"zip.rename.{how}")


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


def _flip_case(name: str, d: Draw) -> str:
    """``name`` with the case of some of its letters changed (at least one, where it has one)."""
    letters = [i for i, c in enumerate(name) if c.isascii() and c.isalpha()]
    if not letters:
        return name
    flips = {d.choice(letters)} | {i for i in letters if d.bool(30)}
    return "".join(c.swapcase() if i in flips else c for i, c in enumerate(name))


# The records torch's reader looks up by name (case-insensitively) when torch.load reads a zip.
LOOKED_UP = (
    "data.pkl",
    "version",
    ".data/version",
    "byteorder",
    ".format_version",
    ".storage_alignment",
    ".data/serialization_id",
)


def z_case_twin(data: bytes, d: Draw, names: list[str]) -> bytes | None:
    """A record torch looks up gets a twin named the same but for case, with other bytes,
    before or after it; or is renamed to such a spelling (torch still finds it)."""
    model = _zip(data)
    if model is None:
        return None
    looked_up = [e for e in model.entries if e.rel in LOOKED_UP or e.rel.startswith("data/")]
    if not looked_up:
        return None
    original = d.choice(looked_up)
    twin_name = original.root + "/" + _flip_case(original.rel, d)
    if twin_name == original.name:
        return None
    if d.bool(25):
        original.name = twin_name
        names.append("zip.case_twin.renamed")
        return _build(model, d)
    payload = original.payload()
    if original.rel == "data.pkl":
        parsed = po.parse(payload)
        ops = p_payload([list(o) for o in parsed[0]], d) if parsed is not None else None
        payload = po.assemble(ops) if ops else (mutate_pickle(payload, d, [], "zip") or payload)
    elif original.rel.startswith("data/"):
        payload = bytes(len(payload)) if d.bool() else payload[::-1]
    else:
        payload = d.choice((b"99", b"big", b"3", b"\xff", payload + b"0"))
    twin = zipfmt.Entry.make(twin_name, payload, original.method)
    at = model.entries.index(original)
    model.entries.insert(at + 1 if d.bool() else at, twin)
    names.append("zip.case_twin." + ("pkl" if original.rel == "data.pkl" else "other"))
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


@_on_an_entry
def z_size(model: zipfmt.ZipModel, e: zipfmt.Entry, d: Draw, names: list[str]) -> None:
    field = d.choice(SIZE_FIELDS)
    true = len(e.raw) if "csize" in field else e.usize
    e.lies[field] = d.interesting_int(true) & 0xFFFFFFFF
    names.append(f"zip.size.{field}")


@_on_an_entry
def z_crc(model: zipfmt.ZipModel, e: zipfmt.Entry, d: Draw, names: list[str]) -> None:
    bad = (e.crc ^ (1 << d.int(0, 31))) & 0xFFFFFFFF
    for field in d.choice((("crc",), ("central_crc",), ("local_crc", "desc_crc"))):
        e.lies[field] = bad
    names.append("zip.crc")


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


@_on_an_entry
def z_method_lie(model: zipfmt.ZipModel, e: zipfmt.Entry, d: Draw, names: list[str]) -> None:
    e.lies[d.choice(("local_method", "central_method"))] = d.choice((8, 0, 12, 14, 99))
    names.append("zip.method_lie")


@_on_an_entry
def z_local_name(model: zipfmt.ZipModel, e: zipfmt.Entry, d: Draw, names: list[str]) -> None:
    other = d.choice(model.entries).name
    e.lies["local_name"] = (other if other != e.name else e.name + "x").encode()
    names.append("zip.local_name")


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
    "case_twin": z_case_twin,
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
ZIP_WEIGHTS = {
    "pickle": 8,
    "storage": 2,
    "size": 2,
    "duplicate": 2,
    "case_twin": 2,
    "prefix": 2,
    "deflate": 2,
}
