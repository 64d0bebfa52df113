"""Where a state dict's tensor bytes come from: each storage of a checkpoint built once.

Torch zip and safetensors records are memory-mapped once per file
(``torch.UntypedStorage.from_file(path, shared=False)``, as ``torch.load(mmap=True)`` maps
them: private, page-cache backed, no anonymous copy) and each storage is a slice of that map;
legacy and tar records are read with ``os.pread`` into fresh storages. A legacy storage view
is a slice of its root, as torch makes it. A big-endian zip's storages are byte-swapped by
their dtype, as torch.load swaps them. Storages go where ``map_location`` says through a
:data:`Restore` function.
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
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.tensor_bytes import ClosesOnExit, OpenFiles, pread_exact
from ckpt_tools.loading.tensor_io import torch_dtype

__all__ = ["Restore", "StorageBuilder"]

#: ``(cpu_storage, saved_tag) -> storage``: where one storage goes (``map_location`` resolved).
Restore = Callable[[torch.UntypedStorage, str], torch.UntypedStorage]

# Formats whose records lie stored (uncompressed) in the file at fixed offsets and may be
# mapped; legacy and tar files are read instead, as torch reads them (it cannot map them).
_MAPPED_FORMATS = frozenset({"torch-zip", "safetensors"})


@dataclass
class StorageBuilder(ClosesOnExit):
    """Builds each storage of one opened checkpoint once, on the device ``restore`` picks.

    Use it as a context manager (or call :meth:`close`): it holds file descriptors for the
    files read with ``pread``. Mapped files stay mapped as long as a tensor uses them.

    Attributes:
        ckpt: the opened checkpoint (a sharded folder's locates storages in its shards).
        restore: where each storage goes.
        mapped: whether any storage came from a memory-mapped file.
    """

    ckpt: Checkpoint
    restore: Restore
    mapped: bool = False
    _formats: dict[str, str] = field(default_factory=dict)
    _maps: dict[str, torch.UntypedStorage] = field(default_factory=dict)
    _files: OpenFiles = field(default_factory=OpenFiles)
    _roots: dict[tuple[str, str], torch.UntypedStorage] = field(default_factory=dict)
    _views: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    _swapped: set[str] = field(default_factory=set)  # files saved in the other byte order

    def __post_init__(self) -> None:
        for sub in (self.ckpt, *self.ckpt.shards.values()):
            self._formats[sub.path] = sub.format
            if sub.byteorder != sys.byteorder:
                self._swapped.add(sub.path)

    def close(self) -> None:
        """Close the descriptors of files read with ``pread``; mapped storages stay valid."""
        self._files.close()
        self._maps.clear()

    def storage(self, ref: StorageRef) -> torch.UntypedStorage:
        """The placed storage ``ref`` stands for (a legacy view: its slice of the root)."""
        found = self._views.get(id(ref))
        if found is not None:
            return found
        span = self.ckpt.span(ref)
        first, end = ref.root_span
        root_offset, root_nbytes = span.offset - first, ref.numel * itemsize(ref.dtype)
        key = (span.path, ref.key)
        root = self._roots.get(key)
        if root is None:
            cpu = self._read(span.path, root_offset, root_nbytes, ref.dtype)
            if span.path in self._swapped:
                # As torch.load swaps it: by the storage's dtype, before it is placed. A mapped
                # storage is a private mapping, so the file itself is never written.
                cpu.byteswap(torch_dtype(ref.dtype))
            root = self._roots[key] = _restored(self.restore(cpu, ref.device))
        found = root if ref.view is None else root[first:end]
        self._views[id(ref)] = found
        return found

    def _read(self, path: str, offset: int, nbytes: int, dtype: str) -> torch.UntypedStorage:
        fmt = self._formats.get(path, "")
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


def _restored(result: Any) -> torch.UntypedStorage:
    # A map_location callable may hand back a TypedStorage (older code): use its bytes.
    untyped = getattr(result, "_untyped_storage", None)
    return untyped if untyped is not None else result
