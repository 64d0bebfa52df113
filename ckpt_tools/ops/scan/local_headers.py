"""A zip's records found by their local headers alone, for an archive whose end records and
central directory neither our reader nor Python's zipfile can read.

torch's reader may still find its records there (the damage can lie in records it does not
need), and a pickle it reads can run code; so the scan looks for every local file header in
the file and walks the records they describe, as a last resort. Nothing here is trusted to
be the archive torch reads: it only finds bytes that a reader could take for a pickle.
"""

from __future__ import annotations

import os
import struct

from ckpt_tools.formats.zip.directory import ZipEntry

__all__ = ["local_entries"]

_SIGNATURE = b"PK\x03\x04"
_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ZIP64 = 0x0001
_CHUNK = 4 << 20
# An archive torch writes holds a few records per tensor; a file with more headers than this
# is not read further.
_MOST = 1 << 16


def local_entries(fd: int, size: int) -> list[ZipEntry]:
    """The records whose local headers ``fd`` holds (``size`` bytes), in file order.

    Sizes come from each header (its zip64 extra field where they overflow); a record whose
    sizes the header leaves out (a data descriptor follows it) runs to the end of the file,
    which the walk's own limits bound. Only stored and deflated records are listed.

    Example:
        >>> import io, os, tempfile, zipfile
        >>> buf = io.BytesIO()
        >>> with zipfile.ZipFile(buf, "w") as z:
        ...     z.writestr("archive/data.pkl", b"\\x80\\x02}q\\x00.")
        >>> fd, name = tempfile.mkstemp()
        >>> _ = os.write(fd, buf.getvalue()[:60])  # the central directory cut off
        >>> [(e.name, e.file_size) for e in local_entries(fd, 60)]
        [('archive/data.pkl', 6)]
        >>> os.close(fd); os.remove(name)
    """
    entries: list[ZipEntry] = []
    for at in _signatures(fd, size):
        entry = _entry_at(fd, at, size)
        if entry is not None:
            entries.append(entry)
        if len(entries) >= _MOST:
            break
    return entries


def _signatures(fd: int, size: int) -> list[int]:
    """Where each local header signature starts, read in chunks that overlap by 3 bytes."""
    found: list[int] = []
    at = 0
    while at < size and len(found) < _MOST:
        chunk = os.pread(fd, _CHUNK + 3, at)
        if not chunk:
            break
        i = chunk.find(_SIGNATURE)
        while i != -1 and i < _CHUNK:
            found.append(at + i)
            i = chunk.find(_SIGNATURE, i + 1)
        at += _CHUNK
    return found


def _entry_at(fd: int, at: int, size: int) -> ZipEntry | None:
    head = os.pread(fd, _HEADER.size, at)
    if len(head) < _HEADER.size:
        return None
    _, _, flags, method, _, _, crc, csize, usize, name_len, extra_len = _HEADER.unpack(head)
    if method not in (0, 8) or flags & 1:  # (encrypted: no reader takes it)
        return None
    names = os.pread(fd, name_len + extra_len, at + _HEADER.size)
    try:
        name = names[:name_len].decode("utf-8")
    except UnicodeDecodeError:
        return None
    usize, csize = _zip64_sizes(names[name_len:], usize, csize)
    start = at + _HEADER.size + name_len + extra_len
    if csize == 0 and flags & 8:  # sizes in a data descriptor after the data
        csize = usize = size - start
    if start + csize > size:
        return None
    return ZipEntry(name, start, csize, usize, crc, method == 8, at)


def _zip64_sizes(extra: bytes, usize: int, csize: int) -> tuple[int, int]:
    """The sizes a zip64 extra field gives where the header's 32-bit fields overflow."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        if tag == _ZIP64:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            if usize == 0xFFFFFFFF and values:
                usize = values.pop(0)
            if csize == 0xFFFFFFFF and values:
                csize = values.pop(0)
        pos += 4 + length
    return usize, csize
