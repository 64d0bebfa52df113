"""Where a state dict's tensor bytes come from: each storage of a checkpoint built once.

Records are read with ``os.pread`` into fresh storages, as ``torch.load`` reads them. Asked
to map (``mmap=True``), torch zip and safetensors records are memory-mapped once per file
(``torch.UntypedStorage.from_file(path, shared=False)``, as ``torch.load(mmap=True)`` maps
them: private, page-cache backed, no anonymous copy) and each storage is a slice of that map;
legacy and tar records are read all the same (torch cannot map them). A zip record that was
re-zipped with deflate is inflated and checked against its size and CRC-32, as torch's zip
reader inflates it (with ``mmap=True`` it is refused: its bytes cannot be mapped). A
legacy storage view
is a slice of its root, as torch makes it. A big-endian zip's storages are byte-swapped by
their dtype, as torch.load swaps them (one without a byteorder record as
``torch.serialization.set_default_load_endianness`` says). Storages go where
``map_location`` says through a :data:`Restore` function.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckpt_tools.descriptors import StorageRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import CorruptCheckpointError, Remedy, UsageError
from ckpt_tools.formats import Checkpoint, ZipRecord
from ckpt_tools.io.tensor_bytes import ClosesOnExit, OpenFiles, decompressed, pread_exact
from ckpt_tools.loading.tensor_io import torch_dtype

__all__ = [
    "EXACT_FORMATS",
    "Restore",
    "StorageBuilder",
    "deflated_records",
    "load_byteorder",
    "placed_storage",
    "unmappable",
]

#: ``(cpu_storage, saved_tag) -> storage``: where one storage goes (``map_location`` resolved).
Restore = Callable[[torch.UntypedStorage, str], torch.UntypedStorage]

# Formats whose records lie stored (uncompressed) in the file at fixed offsets and may be
# mapped; legacy and tar files are read instead, as torch reads them (it cannot map them).
_MAPPED_FORMATS = frozenset({"torch-zip", "safetensors"})
#: Formats whose storages torch reads into the restored storage, which must have the saved size.
EXACT_FORMATS = frozenset({"torch-legacy", "torch-tar"})


def load_byteorder(ckpt: Checkpoint) -> str:
    """The byte order ``torch.load`` reads ``ckpt``'s storages in, as it decides it now.

    A torch zip without a byteorder record (torch < 2.1 wrote none) is read in torch's
    default load endianness (``torch.serialization.set_default_load_endianness``):
    ``little`` when unset or ``LITTLE``, ``big`` for ``BIG``, the host's for ``NATIVE``.

    Args:
        ckpt: an opened checkpoint (one file, not a sharded folder).

    Returns:
        ``little`` or ``big``.

    Example:
        >>> load_byteorder(Checkpoint("a.pt", "torch-zip", {}, {}, byteorder_recorded=True))
        'little'
    """
    if ckpt.format != "torch-zip" or ckpt.byteorder_recorded:
        return ckpt.byteorder
    from torch.serialization import LoadEndianness, get_default_load_endianness

    default = get_default_load_endianness()
    if default == LoadEndianness.BIG:
        return "big"
    return sys.byteorder if default == LoadEndianness.NATIVE else "little"


@dataclass
class StorageBuilder(ClosesOnExit):
    """Builds each storage of one opened checkpoint once, on the device ``restore`` picks.

    Use it as a context manager (or call :meth:`close`): it holds file descriptors for the
    files read with ``pread``. Mapped files stay mapped as long as a tensor uses them.

    Attributes:
        ckpt: the opened checkpoint (a sharded folder's locates storages in its shards).
        restore: where each storage goes.
        mmap: map torch zip and safetensors records instead of reading them (the file must
            then not change while a tensor uses it).
        mapped: whether any storage came from a memory-mapped file.
    """

    ckpt: Checkpoint
    restore: Restore
    mmap: bool = False
    mapped: bool = False
    _formats: dict[str, str] = field(default_factory=dict)
    _maps: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    _files: OpenFiles = field(default_factory=OpenFiles)
    _roots: dict[tuple[str, str], torch.UntypedStorage] = field(default_factory=dict)
    _views: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    _swapped: set[str] = field(default_factory=set)  # files saved in the other byte order
    _deflated: dict[int, tuple[Checkpoint, ZipRecord]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for sub in (self.ckpt, *self.ckpt.shards.values()):
            self._formats[sub.path] = sub.format
            if load_byteorder(sub) != sys.byteorder:
                self._swapped.add(sub.path)
        # Found once, not per storage, by the storage's identity (every shard of a sharded
        # folder has its own data/0).
        for sub, record, ref in deflated_records(self.ckpt):
            self._deflated[id(ref)] = (sub, record)

    def close(self) -> None:
        """Close the descriptors of files read with ``pread``; mapped storages stay valid."""
        self._files.close()
        self._maps.clear()

    def storage(self, ref: StorageRef) -> torch.UntypedStorage:
        """The placed storage ``ref`` stands for (a legacy view: its slice of the root)."""
        found = self._views.get(id(ref))
        if found is not None:
            return found
        first, end = ref.root_span
        root_nbytes = ref.numel * itemsize(ref.dtype)
        owner, record = self._deflated.get(id(ref), (self.ckpt, None))
        if record is None:
            span = self.ckpt.span(ref)
            path, root_offset = span.path, span.offset - first
        else:
            path, root_offset = owner.path, 0
        key = (path, ref.key)
        root = self._roots.get(key)
        if root is None:
            if record is None:
                cpu = self._read(path, root_offset, root_nbytes, ref.dtype)
            elif self.mmap:
                raise unmappable(owner.path, record)
            else:
                cpu = _inflated(owner, record, root_nbytes)
            if path in self._swapped:
                # As torch.load swaps it: by the storage's dtype, before it is placed. A mapped
                # storage is a private mapping, so the file itself is never written.
                cpu.byteswap(torch_dtype(ref.dtype))
            exact = self._formats.get(path) in EXACT_FORMATS
            placed = placed_storage(self.restore(cpu, ref.device), cpu, ref.device, exact)
            root = self._roots[key] = placed
        found = root if ref.view is None else root[first:end]
        self._views[id(ref)] = found
        return found

    def _read(self, path: str, offset: int, nbytes: int, dtype: str) -> torch.UntypedStorage:
        fmt = self._formats.get(path, "") if self.mmap else ""
        # Zip records are 64-byte aligned; a safetensors header may leave an offset that is
        # not a multiple of the element size: such a record is read, not mapped.
        if fmt in _MAPPED_FORMATS and (fmt == "torch-zip" or offset % itemsize(dtype) == 0):
            whole = self._maps.get(path)
            if whole is None:
                size = os.path.getsize(path)
                whole = self._maps[path] = torch.UntypedStorage.from_file(path, False, size)
            if offset + nbytes > whole.nbytes():
                raise CorruptCheckpointError(
                    f"{path!r} ends before a storage does (needed {nbytes} bytes at offset "
                    f"{offset}); the file is truncated",
                    path=path,
                )
            self.mapped = True
            return whole[offset : offset + nbytes]
        return self._pread(path, offset, nbytes)

    def _pread(self, path: str, offset: int, nbytes: int) -> torch.UntypedStorage:
        if nbytes == 0:
            return torch.UntypedStorage(0)
        try:
            buffer = pread_exact(self._files.fd(path), nbytes, offset)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            raise CorruptCheckpointError(
                f"{path!r} ends before a storage does (needed {nbytes} bytes at offset "
                f"{offset}); the file is truncated",
                path=path,
            ) from e
        # frombuffer shares the bytearray (no copy); the storage keeps it alive.
        return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def deflated_records(ckpt: Checkpoint) -> list[tuple[Checkpoint, ZipRecord, StorageRef]]:
    """The compressed storage records of ``ckpt`` and its shards (an archive re-zipped with
    deflate): each with the checkpoint holding it and the storage it holds."""
    found = []
    for sub in (ckpt, *ckpt.shards.values()):
        for name, record in sub.records.items():
            ref = sub.storages.get(name[5:]) if name.startswith("data/") else None
            if record.compressed and ref is not None:
                found.append((sub, record, ref))
    return found


def unmappable(path: str, record: ZipRecord) -> UsageError:
    """The refusal to map a compressed record: torch.load(mmap=True) maps its compressed
    bytes as if they were the values."""
    return UsageError(
        f"{path!r}: record {record.name} is compressed (the archive was re-zipped with "
        "deflate), so its bytes cannot be memory-mapped; torch.load(mmap=True) would map the "
        "compressed bytes as values",
        argument="mmap",
        value="True",
        path=path,
        remedies=(Remedy("mmap", "False", text="to inflate it into memory"),),
    )


def _inflated(ckpt: Checkpoint, record: ZipRecord, nbytes: int) -> torch.UntypedStorage:
    """A deflated storage record's first ``nbytes`` bytes, inflated and checked whole (its
    CRC-32 by :func:`~ckpt_tools.io.tensor_bytes.decompressed`, its size here)."""
    buffer = bytearray()
    try:
        with decompressed(ckpt, record.name) as chunks:
            for piece in chunks:
                buffer += piece
    except OSError as e:
        raise CorruptCheckpointError(f"{ckpt.path!r}: {e}", path=ckpt.path) from e
    if len(buffer) != record.size or len(buffer) < nbytes:
        raise CorruptCheckpointError(
            f"{ckpt.path!r}: record {record.name} inflates to {len(buffer)} bytes; its zip "
            f"entry says {record.size} bytes",
            path=ckpt.path,
        )
    del buffer[nbytes:]
    if not buffer:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def placed_storage(
    result: Any, saved: torch.UntypedStorage, tag: str, exact: bool = False
) -> torch.UntypedStorage:
    """What a ``map_location`` callable returned for the storage ``saved`` (saved on ``tag``),
    checked as ``torch.load`` checks it (None was already made torch's default placement).

    torch.load sets its tensors on the storage it gets: one shorter than saved fails (or is
    resized, uninitialised), and a legacy file's must have exactly the saved size.

    Args:
        result: the callable's answer.
        saved: the storage it was given.
        tag: the storage's saved location, for the message.
        exact: the file is a legacy or tar file (the size must match exactly).

    Returns:
        ``result``.

    Raises:
        UsageError: ``result`` is not a ``torch.UntypedStorage`` (torch.load raises
            TypeError on a tensor, a TypedStorage, a device name ...) or has too few bytes.

    Example:
        >>> placed_storage("cpu", torch.UntypedStorage(4), "cpu")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: map_location: the callable returned a str for a storage \
saved on 'cpu'; torch.load takes only a torch.UntypedStorage or None (where it was saved); \
return storage.to(device) or None from it
    """
    fix = (Remedy(text="return storage.to(device) or None from it"),)
    if not isinstance(result, torch.UntypedStorage):
        raise UsageError(
            f"map_location: the callable returned a {type(result).__name__} for a storage "
            f"saved on {tag!r}; torch.load takes only a torch.UntypedStorage or None (where it "
            "was saved)",
            remedies=fix,
        )
    size, need = result.nbytes(), saved.nbytes()
    if size < need or (exact and size != need):
        raise UsageError(
            f"map_location: the callable returned a storage of {size} bytes for one saved on "
            f"{tag!r} with {need}; torch.load needs {'exactly' if exact else 'at least'} {need}",
            remedies=fix,
        )
    return result
