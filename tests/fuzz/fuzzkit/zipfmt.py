"""Zip archives as editable entry lists, and a writer that can lie in any header field.

:func:`parse_zip` reads what a ``torch.save`` zip holds (central directory first, like every
zip reader; zip64 records and data descriptors understood). :func:`build_zip` writes entries
back, either in torch's own style (data descriptors, 64-byte aligned records, zip64 end
records) or plainly (sizes in the local headers), and takes per-entry ``lies``: header fields
written with values other than the true ones.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

LOCAL = b"PK\x03\x04"
CENTRAL = b"PK\x01\x02"
EOCD = b"PK\x05\x06"
EOCD64 = b"PK\x06\x06"
LOCATOR64 = b"PK\x06\x07"
DESCRIPTOR = b"PK\x07\x08"


@dataclass
class Entry:
    """One record: its name, its bytes as stored, and what the headers should say."""

    name: str
    raw: bytes  # as stored (deflated when method == 8)
    method: int = 0
    crc: int = 0
    usize: int = 0
    lies: dict[str, Any] = field(default_factory=dict)  # local_*/central_* field overrides

    @classmethod
    def make(cls, name: str, payload: bytes, method: int = 0, level: int = 6) -> Entry:
        e = cls(name, b"")
        e.set_payload(payload, method, level)
        return e

    def payload(self) -> bytes:
        if self.method == 8:
            return zlib.decompressobj(-15).decompress(self.raw)
        return self.raw

    def set_payload(self, payload: bytes, method: int | None = None, level: int = 6) -> None:
        self.method = self.method if method is None else method
        if self.method == 8:
            c = zlib.compressobj(level, zlib.DEFLATED, -15)
            self.raw = c.compress(payload) + c.flush()
        else:
            self.raw = payload
        self.crc = zlib.crc32(payload) & 0xFFFFFFFF
        self.usize = len(payload)

    @property
    def root(self) -> str:
        return self.name.partition("/")[0]

    @property
    def rel(self) -> str:
        return self.name.partition("/")[2]


@dataclass
class ZipModel:
    entries: list[Entry]
    prefix: bytes = b""
    comment: bytes = b""

    def find(self, rel: str) -> Entry | None:
        found = [e for e in self.entries if e.rel == rel or e.name == rel]
        return found[-1] if found else None

    def data_pkl(self) -> Entry | None:
        cands = [e for e in self.entries if e.name.endswith("data.pkl")]
        return cands[-1] if cands else None


def _zip64_sizes(extra: bytes, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        body = extra[i + 4 : i + 4 + size]
        if tag == 1:
            vals = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if offset == 0xFFFFFFFF and vals:
                offset = vals.pop(0)
        i += 4 + size
    return usize, csize, offset


def parse_zip(data: bytes) -> ZipModel | None:
    """The entries in central-directory order; None when this is not a zip we can take apart."""
    try:
        return _parse(data)
    except (struct.error, ValueError, IndexError, zlib.error):
        return None


def _parse(data: bytes) -> ZipModel | None:
    end = data.rfind(EOCD)
    if end < 0 or end + 22 > len(data):
        return None
    (_, _, _, _, count, cd_size, cd_offset, clen) = struct.unpack_from("<4sHHHHIIH", data, end)
    comment = data[end + 22 : end + 22 + clen]
    cd_end = end
    loc = end - 20
    if loc >= 0 and data[loc : loc + 4] == LOCATOR64:
        (z64_at,) = struct.unpack_from("<Q", data, loc + 8)
        z64 = data.rfind(EOCD64, 0, loc)
        if z64 < 0:
            return None
        count, cd_size, cd_offset = struct.unpack_from("<QQQ", data, z64 + 32)
        cd_end = z64
        del z64_at
    base = cd_end - (cd_offset + cd_size)
    if base < 0:
        return None
    entries = []
    at = base + cd_offset
    for _ in range(count):
        if data[at : at + 4] != CENTRAL:
            return None
        fields = struct.unpack_from("<4s6H3I5H2I", data, at)
        method, crc, csize, usize = fields[4], fields[7], fields[8], fields[9]
        nlen, elen, klen, offset = fields[10], fields[11], fields[12], fields[16]
        name = data[at + 46 : at + 46 + nlen].decode("utf-8", "surrogateescape")
        extra = data[at + 46 + nlen : at + 46 + nlen + elen]
        usize, csize, offset = _zip64_sizes(extra, usize, csize, offset)
        at += 46 + nlen + elen + klen
        lh = base + offset
        if data[lh : lh + 4] != LOCAL:
            return None
        lnlen, lelen = struct.unpack_from("<HH", data, lh + 26)
        start = lh + 30 + lnlen + lelen
        raw = data[start : start + csize]
        if len(raw) != csize:
            return None
        entries.append(Entry(name, raw, method, crc, usize))
    return ZipModel(entries, data[:base], comment)


def _aligned_extra(offset: int, name_len: int, align: int) -> bytes:
    # torch pads the local header's extra field ("FB" + Z...) so the data starts aligned.
    start = offset + 30 + name_len + 4
    pad = (-start) % align
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


def build_zip(
    model: ZipModel,
    torch_style: bool = True,
    align: int = 64,
    fix_offsets: bool = True,
    eocd_lies: dict[str, int] | None = None,
) -> bytes:
    """Write ``model`` after ``model.prefix``.

    ``fix_offsets``: offsets count from the prefix's end, as if the bytes were prepended to a
    finished archive; otherwise they count from the file's start (both are readable zips).
    """
    out = bytearray(model.prefix)
    base = len(model.prefix) if fix_offsets else 0
    central = []
    for e in model.entries:
        name = e.name.encode("utf-8", "surrogateescape")
        offset = len(out) - base
        lie = e.lies.get
        flags = 0x808 if torch_style else 0x800
        csize = lie("csize", len(e.raw))
        crc, usize = lie("crc", e.crc), lie("usize", e.usize)
        extra = _aligned_extra(len(out), len(name), align) if torch_style and align else b""
        lname = lie("local_name", name)
        if torch_style:
            local_sizes = (lie("local_crc", 0), lie("local_csize", 0), lie("local_usize", 0))
        else:
            local_sizes = (
                lie("local_crc", crc),
                lie("local_csize", csize),
                lie("local_usize", usize),
            )
        out += struct.pack(
            "<4s5H3I2H",
            LOCAL,
            20,
            flags,
            lie("local_method", e.method),
            0,
            0x21,
            *local_sizes,
            len(lname),
            len(extra),
        )
        out += lname + extra + e.raw
        if torch_style:
            out += DESCRIPTOR + struct.pack(
                "<3I", lie("desc_crc", crc), lie("desc_csize", csize), lie("desc_usize", usize)
            )
        central.append(
            struct.pack(
                "<4s6H3I5H2I",
                CENTRAL,
                0x031E if torch_style else 20,
                20,
                flags,
                lie("central_method", e.method),
                0,
                0x21,
                lie("central_crc", crc),
                lie("central_csize", csize),
                lie("central_usize", usize),
                len(name),
                0,
                0,
                0,
                0,
                0,
                lie("central_offset", offset),
            )
            + name
        )
    cd_offset = len(out) - base
    cd = b"".join(central)
    out += cd
    lies = eocd_lies or {}
    count = lies.get("count", len(model.entries))
    if torch_style:
        z64_at = len(out) - base
        out += EOCD64 + struct.pack(
            "<QHHIIQQQQ",
            44,
            0x031E,
            45,
            0,
            0,
            count,
            count,
            lies.get("cd_size", len(cd)),
            lies.get("cd_offset", cd_offset),
        )
        out += LOCATOR64 + struct.pack("<IQI", 0, z64_at, 1)
    out += EOCD + struct.pack(
        "<4HIIH",
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        lies.get("cd_size", len(cd)),
        lies.get("cd_offset", cd_offset),
        len(model.comment),
    )
    out += model.comment
    return bytes(out)
