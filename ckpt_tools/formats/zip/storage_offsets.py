"""Where torch computes a storage record's bytes to be, without reading its local header.

An archive whose ``.format_version`` is ``1`` or more tells ``torch.load`` that its storage
records lie as torch's own writer (miniz) lays them out: back to back in the order the pickle
loads them, starting with ``data/0``, each with the least padding that aligns its bytes and a
data descriptor after them. torch then computes each offset from the one before
(``torch.load(map_location="meta")`` always, ``mmap=True`` with
``torch.utils.serialization.config.load.calculate_storage_offsets``) and reads whatever bytes
lie there. A writer may state that version only for a layout this check accepts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["StorageRecord", "first_misplaced", "in_key_order"]

_U32 = 0xFFFFFFFF
_LOCAL_HEADER = 30  # MZ_ZIP_LOCAL_DIR_HEADER_SIZE


class StorageRecord(NamedTuple):
    """A storage record where it lies in the archive.

    Attributes:
        key: the storage key (``data/<key>`` is its record).
        name_length: the length of its full name in bytes, root folder included.
        header_offset: where its local header starts.
        data_offset: where its bytes start.
        size: how many bytes it holds.
    """

    key: str
    name_length: int
    header_offset: int
    data_offset: int
    size: int


def first_misplaced(records: Sequence[StorageRecord], alignment: int) -> str | None:
    """The first storage whose bytes do not lie where torch computes them, or None.

    Args:
        records: the storage records, in the order the pickle first names their keys
            (the order ``torch.load`` loads them in).
        alignment: the archive's ``.storage_alignment``.

    Returns:
        The key of the first storage torch would read from elsewhere (or whose order makes it
        fail: the first must be ``"0"``), or None when every computed offset is the real one.

    Example:
        >>> first = StorageRecord("0", 14, 0, 64, 8)
        >>> after = 64 + 8 + 16  # the bytes, then the data descriptor
        >>> first_misplaced([first, StorageRecord("1", 14, after, 192, 4)], 64)  # aligned
        >>> first_misplaced([first, StorageRecord("1", 14, after, 128, 4)], 64)
        '1'
    """
    cursor: int | None = None
    for record in records:
        if cursor is None:
            if record.key != "0":  # torch asserts the first storage it loads is "0"
                return record.key
            data = record.data_offset
        else:
            if record.header_offset != cursor:
                return record.key
            data = _computed_data_offset(cursor, record.name_length, record.size, alignment)
            if data != record.data_offset:
                return record.key
        cursor = data + record.size
        if record.size > 0:  # torch's writer puts a data descriptor after every non-empty record
            big = record.header_offset >= _U32 or record.size >= _U32
            cursor += 24 if big else 16
    return None


def in_key_order(records: Sequence[StorageRecord]) -> list[StorageRecord]:
    """``records`` in the order a ``torch.save`` pickle names them, by their keys as numbers;
    as they are where a key is no number (no such layout holds: the first must be ``"0"``).

    Example:
        >>> [r.key for r in in_key_order([StorageRecord(k, 0, 0, 0, 0) for k in ("10", "9")])]
        ['9', '10']
    """
    if not all(r.key.isdecimal() for r in records):
        return list(records)
    return sorted(records, key=lambda r: int(r.key))


def _computed_data_offset(cursor: int, name_length: int, size: int, alignment: int) -> int:
    """Where torch's reader computes a record's bytes to start, given its header's offset
    (caffe2's ``getOffset``): past the header, the name and the padding field, and the zip64
    field where a size or the offset needs one, rounded up to ``alignment``."""
    start = cursor + _LOCAL_HEADER + name_length + 4
    if size >= _U32 or cursor >= _U32:
        start += 4 + (16 if size >= _U32 else 0) + (8 if cursor >= _U32 else 0)
    return start + (-start) % alignment
