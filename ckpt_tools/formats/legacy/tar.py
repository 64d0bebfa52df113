"""Reading torch's tar format (``torch.save`` before 0.4), torch-free.

The file is a tar archive with these members (``sys_info`` is optional and unused)::

    storages  pickle(num_storages)
              num_storages x [ pickle((key, location, storage_type)), int64 numel, bytes ]
              pickle([(view_key, root_key, offset, numel), ...])        storage views
    tensors   pickle(num_tensors)
              num_tensors x [ pickle((key, storage_key, tensor_type)),
                              int32 ndim, 4 pad bytes, ndim x int64 size,
                              ndim x int64 stride, int64 storage_offset ]
    pickle    the saved object; its persistent ids are tensor (or storage) keys

Only the pickles and the small binary headers are read: storage bytes are skipped, and
their absolute file offsets (the member's data offset plus the position inside it) are
recorded. A tensor on a storage view is described on the view's root storage, its offset
shifted by the view's, which is the memory it shares.
"""

from __future__ import annotations

import collections
import errno
import io
import os
import struct
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import GlobalRef, StorageRef, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import CorruptCheckpointError, UnsafeContentError
from ckpt_tools.formats.base import Checkpoint, RangeFile
from ckpt_tools.formats.legacy.reader import offset_locator
from ckpt_tools.formats.pickle.allowlist import checked_tensor
from ckpt_tools.formats.pickle.standins import StorageTypeRef, id_text, module_record
from ckpt_tools.formats.pickle.unpickler import ReadResult, load_pickle

__all__ = ["read_tar_members"]

# How a tar-format tensor is re-emitted by writers: the same call torch.save makes today.
_REBUILD = GlobalRef("torch._utils", "_rebuild_tensor_v2")
_INT64 = struct.Struct("<q")
_NDIM = struct.Struct("<i4x")


@dataclass(frozen=True)
class _View:
    """A storage view: ``numel`` elements of ``root`` from element ``offset``."""

    root: StorageRef
    offset: int
    numel: int


class _MemberFile(RangeFile):
    """One tar member's bytes as a seekable file, read with ``pread`` from the archive."""

    def __init__(self, fd: int, member: tarfile.TarInfo) -> None:
        self._fd, self.start, self.size = fd, member.offset_data, member.size

    def pread(self, count: int, offset: int) -> bytes:
        if offset < 0 or count < 0:  # (the archive's own offset would hide a negative one)
            raise OSError(errno.EINVAL, f"negative offset or count: {offset}, {count}")
        count = min(count, self.size - offset)
        return os.pread(self._fd, count, self.start + offset) if count > 0 else b""


class _TarReader:
    """Reads the three members in order; see the module docstring."""

    def __init__(self, path: str, fd: int, members: Mapping[str, tarfile.TarInfo]) -> None:
        self.path, self.fd, self.members = path, fd, members
        self.file_size = os.fstat(fd).st_size
        self.storages: dict[str, StorageRef] = {}
        self.offsets: dict[str, int] = {}  # root storage key -> absolute file offset
        self.views: dict[str, _View] = {}
        self.tensors: dict[str, TensorRef] = {}
        self.view_refs: dict[str, StorageRef] = {}
        self.unsafe: dict[str, None] = {}

    # -- helpers --------------------------------------------------------------------------

    def member(self, name: str) -> _MemberFile:
        info = self.members[name]
        if not info.isreg():
            raise CorruptCheckpointError(f"{self.path!r}: tar member {name!r} is not a file")
        if info.offset_data + info.size > self.file_size:
            raise CorruptCheckpointError(
                f"{self.path!r} is truncated: tar member {name!r} needs {info.size} bytes at "
                f"offset {info.offset_data}, the file ends at {self.file_size}"
            )
        return _MemberFile(self.fd, info)

    def pickle(self, f: _MemberFile, what: str, **kwargs: Any) -> ReadResult:
        """One pickle of a member; errors name the file and what was being read."""
        try:
            result: ReadResult = load_pickle(f, **kwargs)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{self.path!r}: cannot read {what}: {e}") from e
        self.unsafe.update(dict.fromkeys(result.unsafe_globals))
        return result

    def read_exact(self, f: _MemberFile, n: int, what: str) -> bytes:
        data = f.read(n)
        if len(data) != n:
            raise CorruptCheckpointError(
                f"{self.path!r} is truncated: {what} needs {n} bytes, the member has {len(data)}"
            )
        return data

    def count(self, f: _MemberFile, what: str) -> int:
        value = self.pickle(f, f"the number of {what}").root
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CorruptCheckpointError(
                f"{self.path!r}: expected the number of {what}, found {short_repr(value)}"
            )
        return value

    def storage_of(self, key: Any, what: str) -> tuple[StorageRef, int]:
        """The root storage and element offset that storage ``key`` stands for."""
        name = _key(key)
        if name in self.storages:
            return self.storages[name], 0
        if name in self.views:
            view = self.views[name]
            return view.root, view.offset
        raise CorruptCheckpointError(
            f"{self.path!r}: {what} refers to unknown storage {short_repr(key)}"
        )

    # -- members --------------------------------------------------------------------------

    def read_storages(self) -> None:
        f = self.member("storages")
        for _ in range(self.count(f, "storages")):
            header = self.pickle(f, "a storage header").root
            if not (
                isinstance(header, tuple)
                and len(header) == 3
                and isinstance(header[2], StorageTypeRef)
                and isinstance(header[1], (str, bytes))
            ):
                raise CorruptCheckpointError(
                    f"{self.path!r}: expected a (key, location, storage type) storage header, "
                    f"found {short_repr(header)}"
                )
            key, location, storage_type = header
            name = _key(key)
            (numel,) = _INT64.unpack(self.read_exact(f, 8, f"storage {name}'s size"))
            nbytes = numel * itemsize(storage_type.dtype)
            if numel < 0 or f.tell() + nbytes > f.size:
                raise CorruptCheckpointError(
                    f"{self.path!r} is truncated: storage {name} needs {nbytes} bytes at offset "
                    f"{f.start + f.tell()}, its tar member ends at {f.start + f.size}"
                )
            self.offsets[name] = f.start + f.tell()
            self.storages[name] = StorageRef(
                key=name,
                dtype=storage_type.dtype,
                numel=numel,
                device=id_text(location) or "",
                storage_type=storage_type,
            )
            f.seek(nbytes, io.SEEK_CUR)
        self.read_views(self.pickle(f, "the storage views").root)

    def read_views(self, views: Any) -> None:
        if not isinstance(views, list):
            raise CorruptCheckpointError(f"{self.path!r}: expected a list of storage views")
        for entry in views:
            if not (isinstance(entry, tuple) and len(entry) == 4):
                raise CorruptCheckpointError(
                    f"{self.path!r}: malformed storage view {short_repr(entry)}"
                )
            target, root_key, offset, numel = entry
            target = _key(target)
            root, base = self.storage_of(root_key, f"storage view {target}")
            if not (isinstance(offset, int) and isinstance(numel, int)) or not (
                offset >= 0 and numel >= 0 and base + offset + numel <= root.numel
            ):
                raise CorruptCheckpointError(
                    f"{self.path!r}: storage view {target} ({numel} elements at {offset}) "
                    f"does not fit in storage {root.key!r} of {root.numel} elements"
                )
            self.views[target] = _View(root, base + offset, numel)

    def read_tensors(self) -> None:
        f = self.member("tensors")
        for _ in range(self.count(f, "tensors")):
            header = self.pickle(f, "a tensor header").root
            if not (isinstance(header, tuple) and len(header) == 3):
                raise CorruptCheckpointError(
                    f"{self.path!r}: expected a (key, storage key, tensor type) tensor header, "
                    f"found {short_repr(header)}"
                )
            key, storage_key = _key(header[0]), header[1]
            storage, base = self.storage_of(storage_key, f"tensor {key!r}")
            (ndim,) = _NDIM.unpack(self.read_exact(f, 8, f"tensor {key!r}'s rank"))
            if not 0 <= ndim <= 64:
                raise CorruptCheckpointError(f"{self.path!r}: tensor {key!r} has rank {ndim}")
            geometry = self.read_exact(f, 8 * (2 * ndim + 1), f"tensor {key!r}'s geometry")
            values = struct.unpack(f"<{2 * ndim + 1}q", geometry)
            size, stride, offset = values[:ndim], values[ndim : 2 * ndim], values[-1]
            args = (storage, base + offset, size, stride, False, collections.OrderedDict())
            self.tensors[key] = checked_tensor(_REBUILD, args, storage, storage.dtype, False)

    def resolve(self, pid: Any) -> Any:
        """The main pickle's persistent ids: tensor or storage keys, or module classes.

        Errors raised here are prefixed with the file name by :meth:`pickle`.
        """
        if isinstance(pid, tuple):  # (module class, source file, source)
            return module_record(pid)
        name = _key(pid)
        if name in self.tensors:
            return self.tensors[name]
        if name in self.storages:
            return self.storages[name]
        if name in self.views:
            return self.view_ref(name)
        raise CorruptCheckpointError(
            f"it refers to {short_repr(pid)}, which is neither a tensor nor a storage of the "
            "archive"
        )

    def view_ref(self, name: str) -> StorageRef:
        # A storage view saved as a value: the legacy (key, view) convention of StorageRef.
        if name not in self.view_refs:
            view = self.views[name]
            self.view_refs[name] = StorageRef(
                key=view.root.key,
                dtype=view.root.dtype,
                numel=view.numel,
                device=view.root.device,
                storage_type=view.root.storage_type,
                view=(name, view.offset, view.numel),
            )
        return self.view_refs[name]


def _key(key: Any) -> str:
    """Keys are ints in one member and strings in another; torch compares them as ints."""
    text = id_text(key)
    if text is not None:
        return str(int(text)) if text.isascii() and text.isdigit() and len(text) < 19 else text
    raise CorruptCheckpointError(f"expected a storage or tensor key, found {short_repr(key)}")


def read_tar_members(
    path: str, tar: tarfile.TarFile, members: Mapping[str, tarfile.TarInfo]
) -> Checkpoint:
    """Read a torch tar-format checkpoint's members into a :class:`Checkpoint`.

    Args:
        path: the archive (opened by :func:`ckpt_tools.formats.legacy.reader.open_tar`).
        tar: the open archive; only its member table is used.
        members: member name -> its :class:`tarfile.TarInfo` (``storages``, ``tensors`` and
            ``pickle`` are present).

    Returns:
        A ``torch-tar`` :class:`Checkpoint` whose ``locate`` gives each storage's bytes.

    Raises:
        CorruptCheckpointError: a member is truncated, malformed, or refers to a missing
            storage or tensor.
    """
    del tar  # the offsets in ``members`` are all we need
    fd = os.open(path, os.O_RDONLY)
    reader = _TarReader(path, fd, members)
    try:
        reader.read_storages()
        reader.read_tensors()
        main = reader.pickle(reader.member("pickle"), "the pickle", persistent_load=reader.resolve)
    except CorruptCheckpointError as e:
        if reader.unsafe:  # torch's weights-only unpickler stops at the first of them
            names = tuple(reader.unsafe)
            raise UnsafeContentError(
                f"{path!r}: its pickles refer to global(s) outside the allowlist "
                f"({', '.join(names)}) before the file fails ({e})",
                globals=names,
                path=path,
            ) from e
        raise
    finally:
        os.close(fd)
    storages = dict(reader.storages)
    storages.update({f"{s.key}@{name}": s for name, s in reader.view_refs.items()})
    return Checkpoint(
        path=path,
        format="torch-tar",
        root=main.root,
        storages=storages,
        unsafe_globals=tuple(reader.unsafe),
        protocol=main.protocol,
        beyond_weights_only=main.beyond_weights_only,
        locate=offset_locator(path, reader.offsets),
    )
