"""A strict re-read of a written torch zip archive: does ``torch.load`` parse it as written?

``torch.load(weights_only=True)`` and ``torch.load(mmap=True)`` read a record's bytes in
place, at the offset its local header gives, without decompressing; and its unpickler
executes a fixed set of opcodes. This check holds every output to that, from the bytes on
disk: one root folder, unique names, every record stored (never compressed), its local
header agreeing with the central directory, its bytes inside the file, storages starting on
64-byte boundaries, small records' CRC-32s, and ``data.pkl``'s opcodes.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib

from ckpt_tools.errors import VerificationError
from ckpt_tools.formats.repickle import unsupported_opcodes
from ckpt_tools.io.zipwriter import ALIGNMENT

__all__ = ["check_torch_zip"]

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_SMALL = 1 << 20  # records up to this size have their CRC-32 checked (torch's bookkeeping)


def _fail(why: str) -> VerificationError:
    return VerificationError(f"the written archive is not one torch.load reads: {why}")


def _check_record(fd: int, info: zipfile.ZipInfo, file_size: int) -> int:
    """Check one record's local header and placement; returns where its bytes start."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise _fail(f"record {info.filename!r} is compressed (method {info.compress_type})")
    if info.compress_size != info.file_size:
        raise _fail(f"record {info.filename!r} has two sizes")
    head = os.pread(fd, _LOCAL.size, info.header_offset)
    if len(head) < _LOCAL.size:
        raise _fail(f"the local header of {info.filename!r} lies past the end of the file")
    signature, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack(head)
    name = os.pread(fd, name_len, info.header_offset + _LOCAL.size)
    if signature != 0x04034B50 or method != 0 or name != info.orig_filename.encode():
        raise _fail(f"the local header of {info.filename!r} disagrees with the directory")
    start = info.header_offset + _LOCAL.size + name_len + extra_len
    if start + info.file_size > file_size:
        raise _fail(f"record {info.filename!r} runs past the end of the file")
    return start


def check_torch_zip(path: str) -> int:
    """Check that the torch zip archive at ``path`` is laid out as ``torch.load`` reads it.

    Args:
        path: the written archive (a temp file's ``/proc/self/fd/N`` path works too).

    Returns:
        How many records were checked.

    Raises:
        VerificationError: the first way the archive departs from what torch reads.

    Example:
        >>> check_torch_zip("model.pt")  # data.pkl, 17 storages, and torch's small records
        23
    """
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise _fail(f"its central directory does not read ({e})") from e
    names = [i.filename for i in infos]
    roots = {n.split("/", 1)[0] for n in names}
    if len(set(names)) != len(names) or len(roots) != 1:
        raise _fail("record names repeat, or the records are not under one root folder")
    root = roots.pop()
    fd = os.open(path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        for info in infos:
            start = _check_record(fd, info, file_size)
            inner = info.filename[len(root) + 1 :]
            if inner.startswith("data/") and start % ALIGNMENT:
                raise _fail(f"storage {info.filename!r} starts at {start}, not {ALIGNMENT}-aligned")
            if info.file_size <= _SMALL or inner == "data.pkl":
                payload = os.pread(fd, info.file_size, start)
                if zlib.crc32(payload) != info.CRC:
                    raise _fail(f"record {info.filename!r} fails its CRC-32 check")
                if inner == "data.pkl":
                    _check_pickle(payload)
    finally:
        os.close(fd)
    if f"{root}/data.pkl" not in names:
        raise _fail("it has no data.pkl record")
    return len(infos)


def _check_pickle(payload: bytes) -> None:
    try:
        bad = unsupported_opcodes(payload)
    except ValueError as e:
        raise _fail(f"data.pkl is not a well-formed pickle ({e})") from e
    if bad:
        raise _fail(f"data.pkl uses opcodes torch.load(weights_only=True) rejects: {bad[:8]}")
