"""Mutations of the pre-zip formats: legacy (five pickles, then storages) and torch's tar."""

from __future__ import annotations

import functools
import io
import pickle
import struct
import tarfile
from collections.abc import Callable
from typing import Any

from . import pickleops as po
from .draw import Draw
from .mutate_pickle import mutate_pickle

Mutator = Callable[[bytes, Draw, list[str]], bytes | None]

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
        pickles[0] = pickle.dumps(
            d.choice((0x1950A86A20F9469CFC6C + 1, 0, 119547037146038801333356)), 2
        )
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


def _on_member(
    name: str,
) -> Callable[[Callable[[bytearray, Draw, list[str]], bool]], Mutator]:
    """A mutation of the member ``name`` of a tar-format file: ``edit(payload, d, names)``
    changes a copy of its bytes in place (False: it found nothing to change), the tar is
    built again around it; no input without that member."""

    def wrap(edit: Callable[[bytearray, Draw, list[str]], bool]) -> Mutator:
        @functools.wraps(edit)
        def mutate(data: bytes, d: Draw, names: list[str]) -> bytes | None:
            members = _tar_members(data)
            if not members:
                return None
            named = {info.name: i for i, (info, _) in enumerate(members)}
            if name not in named:
                return None
            i = named[name]
            payload = bytearray(members[i][1])
            if not edit(payload, d, names):
                return None
            members[i] = (members[i][0], bytes(payload))
            return _tar_build(members)

        return mutate

    return wrap


@_on_member("tensors")
def t_binary(payload: bytearray, d: Draw, names: list[str]) -> bool:
    """Shapes, strides, offsets and ndim of the ``tensors`` member; counts of ``storages``."""
    records = _tensor_records(bytes(payload))
    if not records:
        return False
    at, ndim = d.choice(records)
    field = d.choice(("ndim", "shape", "stride", "offset"))
    if field == "ndim":
        struct.pack_into("<i", payload, at, d.choice((ndim + 1, ndim - 1, 0, 1 << 20, -1)))
    else:
        if field != "offset" and ndim == 0:
            return False
        base = {"shape": 8, "stride": 8 + 8 * ndim, "offset": 8 + 16 * ndim}[field]
        where = at + base + (8 * d.int(0, ndim - 1) if field != "offset" else 0)
        (old,) = struct.unpack_from("<q", payload, where)
        new = max(-(2**63), min(2**63 - 1, d.interesting_int(old)))
        struct.pack_into("<q", payload, where, new)
    names.append(f"tar.tensors.{field}")
    return True


@_on_member("storages")
def t_storage_count(payload: bytearray, d: Draw, names: list[str]) -> bool:
    first = po.parse(bytes(payload))
    second = po.parse(bytes(payload), first[1]) if first else None
    if second is None or second[1] + 8 > len(payload):
        return False
    (old,) = struct.unpack_from("<q", payload, second[1])
    struct.pack_into(
        "<q", payload, second[1], max(-(2**63), min(2**63 - 1, d.interesting_int(old)))
    )
    names.append("tar.storages.count")
    return True


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
        info.name = d.choice(
            ("../" + info.name, "/" + info.name, info.name + "x", "./" + info.name)
        )
    elif how == "symlink":
        info.type, info.linkname = (
            tarfile.SYMTYPE,
            d.choice(("/etc/hostname", "../outside", "pickle")),
        )
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
