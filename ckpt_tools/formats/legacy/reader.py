"""Reading legacy torch files: pre-1.6 pickles (also from Python 2) and the older tar format.

The tar reader (:mod:`ckpt_tools.formats.legacy.tar`) shares this module's storage locator.

Legacy pickle layout (``torch.save(..., _use_new_zipfile_serialization=False)``)::

    pickle(MAGIC_NUMBER) pickle(1001) pickle(sys_info) pickle(obj) pickle([storage keys])
    then, per key: int64 element count, then the storage's bytes

Only the pickles and the 8-byte counts are read; storage bytes are skipped by seeking.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tarfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any, BinaryIO

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import (
    CorruptCheckpointError,
    UnsafeContentError,
    UnsupportedFormatError,
    quote_foreign,
)
from ckpt_tools.formats.base import Checkpoint, RangeSource, open_buffered
from ckpt_tools.formats.pickle.allowlist import resolve_allowed
from ckpt_tools.formats.pickle.imports import find_imports
from ckpt_tools.formats.pickle.standins import UNTYPED_STORAGE, id_text
from ckpt_tools.formats.pickle.unpickler import ReadResult, load_pickle

__all__ = ["offset_locator", "open_legacy", "open_pickle", "open_tar"]

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


def _header(f: BinaryIO, what: str, path: str) -> Any:
    """Read one of the pickles around the main one, through the same restricted unpickler.

    torch's ``_legacy_load`` unpickles the magic number, the protocol version, ``sys_info``
    and the storage key list with its weights-only unpickler too, so a global outside the
    allowlist in any of them makes it refuse the file. None of them is data a rewrite could
    carry, so such a global is refused here, naming it, before the value is looked at.
    """
    result = _load(f, path)
    if result.unsafe_globals:
        names = ", ".join(result.unsafe_globals)
        raise UnsafeContentError(
            f"{path!r}: the legacy torch {what} pickle refers to global(s) outside the "
            f"allowlist ({names}); torch.load(weights_only=True) refuses this file too",
            globals=result.unsafe_globals,
        )
    return result.root


def _load(
    f: BinaryIO,
    path: str,
    storage_id_length: int = 5,
    extra_globals: Mapping[str, Any] | None = None,
) -> ReadResult:
    """One of the pickles torch reads back to back, the file left where its next
    ``pickle.load`` starts: past the STOP, or past a FRAME the STOP lies inside that the C
    unpickler reads whole (:class:`ImportScan`'s ``after``, the scan's rule). Where a file
    buffer may hold such a frame instead, our C unpickler read it from a buffered file as
    torch's does on this machine, and the file is left where it left it."""
    start = f.tell()
    result = load_pickle(f, storage_id_length=storage_id_length, extra_globals=extra_globals)
    if "FRAME" in result.beyond_weights_only:  # (without one, the STOP ends it)
        left = f.tell()
        scan = find_imports(f, start)
        if not scan.unsettled and scan.after is not None:
            left = scan.after
        f.seek(left)
    return result


_NESTED_REBUILD = ("torch._utils", "_rebuild_nested_tensor")


def _unreadable_calls(path: str) -> dict[str, Any]:
    """The main pickle's allowlisted calls that torch's legacy reader cannot make correctly.

    It reads the storage bytes only after the whole pickle: a nested tensor's rebuild views
    its buffer through sizes and offsets still uninitialised, so torch.load fails on such a
    file ("Storage size calculation overflowed") or, by chance, builds garbage.
    """
    caller = resolve_allowed(*_NESTED_REBUILD)
    assert caller is not None  # on the allowlist: the zip reader builds it

    def refuse(func: Any, *args: Any) -> Any:
        raise UnsupportedFormatError(
            f"{path!r} holds a nested tensor in torch's legacy (non-zip) format, which "
            "torch.load rebuilds before it reads the storage bytes, from uninitialised sizes: "
            "it fails on this file or builds garbage, so the file is not read",
            path=path,
        )

    return {caller.qualname: replace(caller, build=refuse)}


def _expect(f: BinaryIO, what: str, check: Any, path: str) -> Any:
    # torch compares with != (so 1001.0 passes as it does there), and refuses anything else.
    value = _header(f, what, path)
    if value != check:
        raise CorruptCheckpointError(
            f"{path!r}: expected the legacy torch {what} {check!r}, found {short_repr(value)}"
        )
    return value


def open_legacy(path: str, *, source: RangeSource | None = None) -> Checkpoint:
    """Open a legacy (pre-1.6, non-zip) torch file without loading tensors.

    Args:
        path: the file (its URL where ``source`` is given).
        source: the file read by ranges (a remote file); None reads ``path``. Each
            storage's element count (8 bytes before its bytes) is then checked when the
            storage is located, not now: remotely each costs a request.

    Returns:
        A :class:`Checkpoint` of format ``torch-legacy``.

    Raises:
        CorruptCheckpointError: the layout is broken or the file is truncated.
    """
    with _opened(path, source) as (f, size):
        _expect(f, "magic number", MAGIC_NUMBER, path)
        _expect(f, "protocol version", PROTOCOL_VERSION, path)
        # Unpickled (and checked) as torch does, then unused as there: torch's legacy writer
        # stores storage bytes little-endian on every machine, whatever sys_info says.
        _header(f, "sys_info", path)
        main = _load(f, path, storage_id_length=6, extra_globals=_unreadable_calls(path))
        _refuse_untyped(main.storages.values(), path)
        keys = _header(f, "storage key list", path)
        if not isinstance(keys, list):
            raise CorruptCheckpointError(f"{path!r}: expected the list of storage keys")
        roots = {s.key: s for s in main.storages.values()}
        offsets: dict[str, int] = {}
        position = f.tell()
        for key in keys:
            text = id_text(key)
            storage = roots.get(text) if text is not None else None
            # torch finds the storage by the key itself: "0" in the pickle is not 0 here.
            raw = main.raw_keys.get(text, key) if text is not None else None
            if storage is None or type(raw) is not type(key) or raw != key:
                raise CorruptCheckpointError(
                    f"{path!r}: storage key {short_repr(key)} is not in the pickle"
                )
            if source is None:
                _check_count(path, storage, lambda n, at: os.pread(f.fileno(), n, at), position)
            offsets[storage.key] = position + 8
            position += 8 + storage.nbytes
            if position > size:
                raise CorruptCheckpointError(
                    f"{path!r} is truncated: storage {key!r} needs {storage.nbytes} bytes at "
                    f"offset {position - storage.nbytes}, the file ends at {size}"
                )
    _check_all_stored(path, roots, offsets)
    locate = offset_locator(path, offsets)
    if source is not None:
        locate = _counted(path, roots, offsets, source, locate)
    return Checkpoint(
        path=path,
        format="torch-legacy",
        root=main.root,
        storages=main.storages,
        unsafe_globals=main.unsafe_globals,
        protocol=main.protocol,
        beyond_weights_only=main.beyond_weights_only,
        locate=locate,
    )


@contextlib.contextmanager
def _opened(path: str, source: RangeSource | None) -> Iterator[tuple[BinaryIO, int]]:
    """``path`` (or ``source``) as a buffered binary file, and its size."""
    with open_buffered(path, source) as f:
        yield f, os.fstat(f.fileno()).st_size if source is None else source.size


def _check_count(
    path: str, storage: StorageRef, pread: Callable[[int, int], bytes], position: int
) -> None:
    """The element count before a storage's bytes, checked as torch checks it."""
    count_bytes = pread(8, position)
    if len(count_bytes) < 8:
        raise CorruptCheckpointError(
            f"{path!r} is truncated: storage {storage.key!r} is missing (its count at "
            f"offset {position} is past the end)"
        )
    (count,) = struct.unpack("<q", count_bytes)
    if count * itemsize(storage.dtype) != storage.nbytes:
        # torch.load refuses this too ("storage has wrong size"); reading on would take the
        # next storage's bytes for this one's.
        raise CorruptCheckpointError(
            f"{path!r}: storage {storage.key!r} holds {count} elements in the file, but the "
            f"pickle says {storage.numel}; the file is damaged"
        )


def _counted(
    path: str,
    roots: Mapping[str, StorageRef],
    offsets: Mapping[str, int],
    source: RangeSource,
    locate: Callable[[StorageRef], ByteSpan],
) -> Callable[[StorageRef], ByteSpan]:
    """``locate``, with each root storage's count checked the first time it is located."""
    checked: set[str] = set()

    def counted(storage: StorageRef) -> ByteSpan:
        span = locate(storage)
        root = storage.key  # a view's key is its root storage's
        if root not in checked and root in offsets:
            _check_count(path, roots[root], source.pread, offsets[root] - 8)
            checked.add(root)
        return span

    return counted


def _check_all_stored(
    path: str, roots: Mapping[str, StorageRef], offsets: Mapping[str, int]
) -> None:
    """Refuse a storage the main pickle names that the file does not store: torch.load hands
    back uninitialized memory for it, and no offset could locate its bytes here."""
    missing = [key for key in roots if key not in offsets]
    if missing:
        stored = ", ".join(repr(k) for k in list(offsets)[:4])
        more = f" and {len(offsets) - 4} more" if len(offsets) > 4 else ""
        raise CorruptCheckpointError(
            f"{path!r}: the pickle names storage {short_repr(missing[0])}, which the file "
            f"does not store (it stores {stored or 'none'}{more}); the file is damaged"
        )


def _refuse_untyped(storages: Any, path: str) -> None:
    """torch's legacy reader takes a storage's dtype from its class: an ``UntypedStorage`` (what
    the legacy writer names for float8, uint16, complex32 ...) has none, so torch.load fails
    ("has no attribute 'dtype'") on every such file, with or without ``weights_only``."""
    for storage in storages:
        ref = storage.storage_type
        if (ref.module, ref.name) == (UNTYPED_STORAGE.module, UNTYPED_STORAGE.name):
            raise UnsupportedFormatError(
                f"{path!r}: storage {storage.key!r} ({storage.dtype}) is saved as "
                "torch.storage.UntypedStorage, which torch's legacy reader cannot load; "
                "torch.load fails on this file, so it is not read",
                path=path,
            )


def offset_locator(path: str, offsets: Mapping[str, int]) -> Callable[[StorageRef], ByteSpan]:
    """The ``Checkpoint.locate`` of a file whose root storages start at known offsets.

    The legacy and tar readers record where each root storage's bytes start; a legacy view
    (``StorageRef.view``) is located inside its root by :attr:`StorageRef.root_span`.

    Args:
        path: the file.
        offsets: root storage key -> file offset of its first byte.

    Returns:
        A function from a storage of the file to its :class:`ByteSpan`.

    Example:
        >>> locate = offset_locator("old.pt", {"0": 96})
        >>> locate(StorageRef("0", "float32", 12, "cpu", view=("2", 4, 6)))
        ByteSpan(path='old.pt', offset=112, nbytes=24)
    """

    def locate(storage: StorageRef) -> ByteSpan:
        first, end = storage.root_span
        return ByteSpan(path, offsets[storage.key] + first, end - first)

    return locate


def open_pickle(path: str, *, source: RangeSource | None = None) -> Checkpoint:
    """Open a plain pickle file (``pickle.dump`` of a dict of numbers, say) safely.

    Args:
        path: the file (its URL where ``source`` is given).
        source: the file read by ranges (a remote file); None reads ``path``.

    Raises:
        CorruptCheckpointError: not a readable pickle.
    """
    with _opened(path, source) as (f, _):
        result = load_pickle(f)
    if result.storages:
        raise CorruptCheckpointError(
            f"{path!r}: a plain pickle that refers to torch storages it does not contain"
        )
    return Checkpoint(
        path=path,
        format="pickle",
        root=result.root,
        storages={},
        unsafe_globals=result.unsafe_globals,
        protocol=result.protocol,
        beyond_weights_only=result.beyond_weights_only,
    )


def open_tar(path: str) -> Checkpoint:
    """Open a torch tar-format file (torch < 0.4): members sys_info, pickle, storages, tensors.

    Raises:
        CorruptCheckpointError: a member is missing or broken.
    """
    try:
        with tarfile.open(path, mode="r:") as tar:
            members = {m.name: m for m in tar.getmembers()}
            missing = {"pickle", "storages", "tensors"} - set(members)
            if missing:
                raise CorruptCheckpointError(
                    f"{path!r} is a tar archive without the torch members {sorted(missing)}"
                )
            return _read_tar(path, tar, members)
    except (tarfile.TarError, ValueError) as e:  # (a PAX header tarfile cannot parse: ValueError)
        raise CorruptCheckpointError(
            f"{path!r}: the tar archive cannot be read ({quote_foreign(e)})"
        ) from e


def _read_tar(path: str, tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo]) -> Checkpoint:
    from ckpt_tools.formats.legacy.tar import read_tar_members

    return read_tar_members(path, tar, members)
