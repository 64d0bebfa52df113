"""A zip archive's end record and its zip64 form, found as torch's reader (miniz) finds them:
where the central directory lies, and how many records it declares."""

from __future__ import annotations

import struct

from ckpt_tools.formats.zip.source import ZipSource, corrupt_zip, pread

__all__ = ["end_records"]

_EOCD = struct.Struct("<4s4H2LH")
_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_MAX_COMMENT = 0xFFFF
# torch's reader (miniz) looks for the end record in blocks of this size, from the end back.
_MINIZ_BLOCK = 4096
_U16, _U32 = 0xFFFF, 0xFFFFFFFF


def end_records(path: str, fd: ZipSource, size: int) -> tuple[int, int, int, int]:
    """``(record count, directory offset, directory size, end record offset)``, from the end
    record and, where the archive has one, its zip64 end record."""
    eocd_offset, fields = _end_record(path, fd, size)
    disk, cd_disk, disk_count, count, cd_size, cd_offset = fields
    if disk != 0 or cd_disk != 0 or disk_count != count:
        raise corrupt_zip(path, "it spans several disks")
    locator = b""
    if eocd_offset >= _ZIP64_LOCATOR.size:
        locator = pread(fd, _ZIP64_LOCATOR.size, eocd_offset - _ZIP64_LOCATOR.size)
    if locator[:4] != b"PK\x06\x07":
        if count == _U16 or _U32 in (cd_size, cd_offset):
            raise corrupt_zip(path, "its zip64 end record is missing")
        return count, cd_offset, cd_size, eocd_offset
    return _zip64_end_record(path, fd, locator, eocd_offset, (count, cd_size, cd_offset))


def _end_record(
    path: str, fd: ZipSource, size: int
) -> tuple[int, tuple[int, int, int, int, int, int]]:
    """Where the end record torch's reader takes lies, and its fields ``(disk, directory
    disk, records on this disk, records, directory size, directory offset)``."""
    tail_len = min(size, _EOCD.size + _MAX_COMMENT)
    tail = pread(fd, tail_len, size - tail_len)
    # torch's reader (miniz) takes the last signature with a whole record after it, whatever
    # its comment length says, so a signature inside another record's comment is the one it
    # reads. That record's comment must then run exactly to the end of the file (torch.save
    # writes none): anything else is refused.
    end = len(tail)
    at = tail.rfind(_EOCD_SIG)
    while at >= 0 and at + _EOCD.size > end:
        at = tail.rfind(_EOCD_SIG, 0, at)
    if at < 0:
        raise corrupt_zip(path, "no end record ends the file (truncated, or bytes follow it)")
    eocd_offset = size - tail_len + at
    _, disk, cd_disk, disk_count, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    follows = end - at - _EOCD.size
    if comment > follows:
        raise corrupt_zip(
            path,
            f"its end record (at byte {eocd_offset}) declares a {comment}-byte comment where "
            f"{follows} bytes follow it (the file is truncated, or the length is corrupt)",
        )
    if comment < follows:
        raise corrupt_zip(
            path,
            f"{follows - comment} bytes follow its last end record and comment (at byte "
            f"{eocd_offset}: bytes were appended after the archive, or that record lies inside "
            "another record's comment, and it is the one torch reads); "
            f"an archive ends at byte {eocd_offset + _EOCD.size + comment}",
        )
    # miniz scans back in 4 KiB blocks, each 3 bytes over the last, and one that would start
    # before byte 0 wraps around and fails instead of starting at 0.
    scanned_from = (size - _MINIZ_BLOCK) % (_MINIZ_BLOCK - 3) if size > _MINIZ_BLOCK else 0
    if eocd_offset < scanned_from:
        raise corrupt_zip(
            path,
            f"its end record (at byte {eocd_offset}) lies before byte {scanned_from}, where "
            f"torch's reader stops looking for it in a {size}-byte file (a long comment in a "
            "small archive)",
        )
    return eocd_offset, (disk, cd_disk, disk_count, count, cd_size, cd_offset)


def _zip64_end_record(
    path: str,
    fd: ZipSource,
    locator: bytes,
    eocd_offset: int,
    declared: tuple[int, int, int],
) -> tuple[int, int, int, int]:
    """The zip64 end record ``locator`` points at, checked as miniz checks it and against the
    end record's ``(record count, directory size, directory offset)``; returns what
    :func:`_end_records` does."""
    _, _, zip64_offset, disks = _ZIP64_LOCATOR.unpack(locator)
    if disks != 1:  # miniz (torch's reader) refuses any other total as a multi-disk archive
        raise corrupt_zip(
            path, f"its zip64 locator declares {disks} disks (it spans several disks)"
        )
    if zip64_offset + _ZIP64_EOCD.size > eocd_offset - _ZIP64_LOCATOR.size:
        raise corrupt_zip(path, "its zip64 end record is misplaced")
    record = _ZIP64_EOCD.unpack(pread(fd, _ZIP64_EOCD.size, zip64_offset))
    if record[0] != b"PK\x06\x06":
        raise corrupt_zip(
            path,
            "its zip64 end record is not where its locator says (bytes were added before or "
            "inside the archive; torch refuses such a file)",
        )
    if record[1] < _ZIP64_EOCD.size - 12:  # the size it declares for itself, as miniz checks
        raise corrupt_zip(path, f"its zip64 end record declares a size of {record[1]} bytes")
    if record[4] != 0 or record[5] != 0:
        raise corrupt_zip(path, "its zip64 end record places it on another disk (several disks)")
    if record[-4] != record[-3] or any(
        short not in (_U16, _U32) and short != long for short, long in zip(declared, record[-3:])
    ):
        raise corrupt_zip(path, "its end record and zip64 end record declare different records")
    return record[-3], record[-1], record[-2], zip64_offset
