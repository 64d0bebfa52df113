"""The pickles of a tar-format checkpoint's members, found as torch's ``legacy_load`` reads
them: ``sys_info`` and ``pickle`` hold one each; ``storages`` and ``tensors`` a count, then per
item a pickle and the binary data after it, then (``storages``) one pickle of the views.
Counts and storage headers are read as torch reads them, whatever their size.

torch unpickles every one of them with the full unpickler, so a payload can sit in any; the
reader of :mod:`~ckpt_tools.formats.legacy.tar` sees them only where nothing stops it first
(a malformed ``sys_info``, which torch never reads), so the scan walks them itself. Nothing is
unpickled but the counts and storage headers, by an unpickler that builds plain values only
(a global is its name).
"""

from __future__ import annotations

import io
import pickle
import struct
import tarfile
from collections.abc import Iterator
from typing import BinaryIO

from ckpt_tools.dtypes import STORAGE_TYPE_DTYPE, itemsize
from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats.pickle.expansion import check_expansion
from ckpt_tools.formats.pickle.imports import UNREAD, ImportScan, find_imports
from ckpt_tools.formats.pickle.unpickler import MAX_PICKLE_BYTES
from ckpt_tools.ops.scan.sequence import buffered_walks

__all__ = ["member_pickles"]

_MEMBERS = ("sys_info", "pickle", "storages", "tensors")
_INT64 = struct.Struct("<q")
_NDIM = struct.Struct("<i4x")


class _Global:
    """A global a plain-values pickle names, by name only: never imported, never callable."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _PlainValues(pickle.Unpickler):
    """Builds plain values only: a global becomes its name, a persistent id is refused."""

    def find_class(self, module: str, name: str) -> object:
        return _Global(module, name)

    def persistent_load(self, pid: object) -> object:
        raise pickle.UnpicklingError("persistent id refused")


_NOTHING = object()


def member_pickles(path: str) -> Iterator[tuple[str, ImportScan]]:
    """Each pickle of the tar-format file ``path``'s members torch reads, walked: ``sys_info``
    and ``pickle`` whole, ``storages`` and ``tensors`` as :func:`_walk_member` finds them.

    Raises:
        tarfile.TarError, EOFError: the archive cannot be listed.
        CorruptCheckpointError: the ``pickle`` member's FRAMEs make too many readings.
    """
    with tarfile.open(path, mode="r:") as tar:
        for member in tar.getmembers():
            if member.issym() and member.name in ("storages", "tensors"):
                # torch extracts these (links as links) and opens the result: a file anywhere
                # (/proc/self/fd/N: the checkpoint's own bytes), which no walk here reaches.
                yield member.name, ImportScan((UNREAD,), None)
                continue
            # A hard link is read as the member it names (torch extracts it so); so is a
            # symbolic one named pickle, which torch reads with extractfile (it follows it).
            linked = member.islnk() or (member.issym() and member.name == "pickle")
            if member.name not in _MEMBERS or not (member.isreg() or linked):
                continue
            try:
                file = tar.extractfile(member)
            except KeyError:  # a link to a member the archive does not hold
                if member.name in ("storages", "tensors"):  # extracted: linked to a file
                    yield member.name, ImportScan((UNREAD,), None)  # outside, if it exists
                continue
            if file is None:
                continue
            with file:
                if member.name == "pickle":  # read from a buffered file (its frames may vary)
                    yield from ((member.name, s) for s in buffered_walks(file, 0, cut_globals=True))
                else:
                    yield from _walk_member(member.name, file)


def _walk_member(name: str, f: BinaryIO) -> Iterator[tuple[str, ImportScan]]:
    """Each pickle of the member ``name`` (``storages`` or ``tensors``) in ``f``, walked, in
    the order torch unpickles them; the walk stops where torch's reading would stop.

    torch extracts both and reads them unbuffered (``open(..., "rb", 0)``: no ``peek``), so
    each next pickle starts where :func:`find_imports` says the C unpickler left the file.

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
    counted = name in ("storages", "tensors")
    count = _count(f, first) if counted else None
    if count is None and counted and first.imports:
        count = size  # a count built by a call torch makes: every item the member holds
    if count is None:
        return
    pos, index = first.after or 0, 1
    for _ in range(count):
        if pos >= size:
            return
        index += 1
        scan = find_imports(f, pos, cut_globals=True)
        yield f"{name} {index}", scan
        after = None if scan.after is None else _skip(name, f, pos, scan.after, size)
        if after is None:
            if scan.imports and scan.after is not None and scan.after < size:
                # Sized by what a call builds: torch reads on, this walk cannot.
                yield f"{name} {index + 1}", ImportScan((UNREAD._replace(position=pos),), None)
            return  # (else torch fails there too: a broken pickle or header)
        pos = after
    if name == "storages" and pos < size:
        yield f"{name} {index + 1}", find_imports(f, pos, cut_globals=True)  # the storage views


def _plain(f: BinaryIO, start: int, end: int) -> object:
    """The plain value the pickle in ``f[start:end]`` builds, or ``_NOTHING`` where it builds
    none. Read from memory (no ``peek``, as torch's unbuffered file), checked for a memo bomb
    first."""
    if end - start > MAX_PICKLE_BYTES:
        raise CorruptCheckpointError(f"a {end - start}-byte pickle in a tar member is not read")
    f.seek(start)
    data = f.read(end - start)
    try:
        check_expansion(data)
        return _PlainValues(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, ResourceLimitError):
        return _NOTHING


def _count(f: BinaryIO, scan: ImportScan) -> int | None:
    """The item count a member's first pickle holds (``range`` of it: none below 0), or None
    where it holds none."""
    if scan.after is None or scan.imports:
        return None  # (a global there is reported; a loader imports it before counting)
    value = _plain(f, 0, scan.after)
    return max(value, 0) if isinstance(value, int) else None


def _skip(name: str, f: BinaryIO, start: int, end: int, size: int) -> int | None:
    """Where the item's binary part after its pickle (``f[start:end]``) ends, or None where
    torch would fail to read it: a storage's element count and bytes, or a tensor's ndim,
    sizes, strides and offset."""
    if name == "storages":
        # torch unpacks (key, location, storage_type) and sizes elements by storage_type.
        args = _plain(f, start, end)
        storage_type = args[2] if isinstance(args, tuple) and len(args) == 3 else None
        dtype = STORAGE_TYPE_DTYPE.get(getattr(storage_type, "name", None) or "")
        f.seek(end)
        head = f.read(_INT64.size)
        if dtype is None or len(head) < _INT64.size:
            return None
        count = _INT64.unpack(head)[0]  # (elements)
        length = _INT64.size + count * itemsize(dtype)
    else:  # ndim, 4 pad bytes, ndim sizes and strides, the storage offset
        f.seek(end)
        head = f.read(_NDIM.size)
        if len(head) < _NDIM.size:
            return None
        count = _NDIM.unpack(head)[0]
        length = _NDIM.size + 16 * count + _INT64.size
    return end + length if count >= 0 and end + length <= size else None
