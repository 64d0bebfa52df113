"""The pickles of a tar-format checkpoint's members, found as torch's ``legacy_load`` reads
them: ``sys_info`` and ``pickle`` hold one each; ``storages`` and ``tensors`` a count, then per
item a pickle and the binary data after it, then (``storages``) one pickle of the views.

torch unpickles every one of them with the full unpickler, so a payload can sit in any; the
reader of :mod:`~ckpt_tools.formats.legacy.tar` sees them only where nothing stops it first
(a malformed ``sys_info``, which torch never reads), so the scan walks them itself. Nothing is
unpickled but the counts, by an unpickler that builds plain values only.
"""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

from ckpt_tools.dtypes import STORAGE_TYPE_DTYPE, itemsize
from ckpt_tools.formats.pickle.imports import ImportScan, find_imports

__all__ = ["member_pickles"]

_MEMBERS = ("sys_info", "pickle", "storages", "tensors")
_INT64 = struct.Struct("<q")
_NDIM = struct.Struct("<i4x")
# A count is a small int, pickled in a few bytes; anything larger is not one torch wrote.
_COUNT_BYTES = 64


class _PlainValues(pickle.Unpickler):
    """Builds plain values only: every global and persistent id is refused, never looked up."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"global {module}.{name} refused")

    def persistent_load(self, pid: object) -> object:
        raise pickle.UnpicklingError("persistent id refused")


def member_pickles(path: str) -> Iterator[tuple[str, ImportScan]]:
    """Each pickle of the tar-format file ``path``'s members torch reads, walked: ``sys_info``
    and ``pickle`` whole, ``storages`` and ``tensors`` as :func:`_walk_member` finds them.

    Raises:
        tarfile.TarError, EOFError: the archive cannot be listed.
    """
    with tarfile.open(path, mode="r:") as tar:
        for member in tar.getmembers():
            # A hard link is read as the member it names (torch extracts it so).
            if member.name not in _MEMBERS or not (member.isreg() or member.islnk()):
                continue
            try:
                file = tar.extractfile(member)
            except KeyError:  # a link to a member the archive does not hold
                continue
            if file is None:
                continue
            with file:
                yield from _walk_member(member.name, file)


def _walk_member(name: str, f: BinaryIO) -> Iterator[tuple[str, ImportScan]]:
    """Each pickle of the member ``name`` (``storages`` or ``tensors``) in ``f``, walked, in
    the order torch unpickles them; the walk stops where torch's reading would stop.

    Args:
        name: the member's name; any other member holds one pickle.
        f: the member's bytes, seekable.

    Returns:
        ``(where, scan)`` for each pickle: ``"storages"``, ``"storages 2"``, ...

    Example:
        >>> data = pickle.dumps(0, protocol=2) + pickle.dumps([], protocol=2)
        >>> [where for where, _ in _walk_member("storages", io.BytesIO(data))]
        ['storages', 'storages 2']
    """
    size = f.seek(0, io.SEEK_END)
    first = find_imports(f, 0, cut_globals=True)
    yield name, first
    count = _count(f, first) if name in ("storages", "tensors") else None
    if count is None:
        return
    pos, index = first.end or 0, 1
    for _ in range(count):
        index += 1
        scan = find_imports(f, pos, cut_globals=True)
        yield f"{name} {index}", scan
        after = None if scan.end is None else _skip(name, f, scan, size)
        if after is None:
            return  # (torch fails there too: a broken pickle or header, an unknown storage)
        pos = after
    if name == "storages" and pos < size:
        yield f"{name} {index + 1}", find_imports(f, pos, cut_globals=True)  # the storage views


def _count(f: BinaryIO, scan: ImportScan) -> int | None:
    """The item count a member's first pickle holds, or None where it holds none."""
    if scan.end is None or scan.imports or scan.end > _COUNT_BYTES:
        return None
    f.seek(0)
    try:
        value = _PlainValues(io.BytesIO(f.read(scan.end))).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError):
        return None
    return value if type(value) is int and value >= 0 else None


def _skip(name: str, f: BinaryIO, scan: ImportScan, size: int) -> int | None:
    """Where the item's binary part after its pickle ends, or None where torch would fail
    to read it: a storage's element count and bytes, or a tensor's ndim, sizes, strides and
    offset."""
    assert scan.end is not None
    f.seek(scan.end)
    if name == "storages":
        # torch resolves the storage class by its name alone (any "...Storage" global).
        known = [STORAGE_TYPE_DTYPE[i.name] for i in scan.imports if i.name in STORAGE_TYPE_DTYPE]
        head = f.read(_INT64.size)
        if not known or len(head) < _INT64.size:
            return None
        count = _INT64.unpack(head)[0]  # (elements)
        length = _INT64.size + count * itemsize(known[-1])
    else:  # ndim, 4 pad bytes, ndim sizes and strides, the storage offset
        head = f.read(_NDIM.size)
        if len(head) < _NDIM.size:
            return None
        count = _NDIM.unpack(head)[0]
        length = _NDIM.size + 16 * count + _INT64.size
    end = scan.end + length
    return end if count >= 0 and end <= size else None
