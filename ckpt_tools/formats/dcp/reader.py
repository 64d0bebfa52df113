"""torch.distributed.checkpoint (DCP) folders, read torch-free.

A DCP folder holds a ``.metadata`` pickle (read as data by
:mod:`ckpt_tools.formats.dcp.metadata`) and ``__{rank}_{n}.distcp`` files. With the default
serialization every item in a ``.distcp`` file is a complete ``torch.save`` archive at an
offset, whose record offsets are relative to that offset (torch reads it through a file
view): a tensor chunk's archive holds one tensor, a value's (``BYTE_IO``) any pickle, read
here through the restricted unpickler like every pickle.

The opened checkpoint's root is the state dict nested as DCP's ``planner_data`` says (keys
are never split on dots); each tensor stands for its global shape and dtype, and
:meth:`DcpCheckpoint.chunk_tensor` locates each chunk's bytes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef, contiguous_stride
from ckpt_tools.errors import CorruptCheckpointError, UsageError
from ckpt_tools.formats.base import Checkpoint, consolidate_first
from ckpt_tools.formats.dcp.layout import METADATA_FILE
from ckpt_tools.formats.dcp.metadata import (
    DcpBytes,
    DcpChunk,
    DcpMetadata,
    DcpTensor,
    read_metadata,
)
from ckpt_tools.formats.dcp.safetensors import safetensors_chunk
from ckpt_tools.formats.detect import ZIP_SIGNATURE
from ckpt_tools.formats.pickle.standins import storage_type_ref
from ckpt_tools.formats.zip.directory import FileSlice
from ckpt_tools.formats.zip.torch_records import refuse_big_endian
from ckpt_tools.formats.zip.torchzip import ArchiveContents, read_torch_archive

__all__ = [
    "DcpCheckpoint",
    "needs_consolidating",
    "open_dcp",
]


@dataclass(frozen=True)
class ChunkData:
    """A chunk's tensor as its archive holds it, and the file span of that tensor's storage."""

    chunk: DcpChunk
    tensor: TensorRef
    span: ByteSpan
    crc32: int | None


@dataclass(frozen=True)
class DcpCheckpoint(Checkpoint):
    """A DCP folder opened: the :class:`Checkpoint` fields plus its metadata.

    Attributes:
        dcp: the checked metadata (every item, its chunks and their files).
        tensors: id of each root tensor descriptor -> its DCP item.
    """

    dcp: DcpMetadata | None = None
    tensors: Mapping[int, DcpTensor] = field(default_factory=dict, repr=False)

    def item_of(self, tensor: TensorRef) -> DcpTensor:
        """The DCP item a root tensor stands for."""
        return self.tensors[id(tensor)]

    def chunk_tensor(self, item: DcpTensor, chunk: DcpChunk) -> ChunkData:
        """Read ``chunk``'s archive and locate its tensor's bytes.

        Raises:
            CorruptCheckpointError: the archive is not one tensor of the chunk's dtype and
                sizes, or its storage is compressed.
        """
        where = os.path.join(self.path, chunk.file)
        fd = os.open(where, os.O_RDONLY)
        try:
            if os.pread(fd, 4, chunk.offset) != ZIP_SIGNATURE:
                # SerializationFormat.SAFETENSORS: a raw range in the rank's safetensors blob.
                tensor, span = safetensors_chunk(where, fd, item, chunk)
                return ChunkData(chunk, tensor, span, None)
        finally:
            os.close(fd)
        contents = _read_archive(where, chunk.offset, chunk.length)
        t = contents.result.root
        what = f"{where!r}: the chunk of {item.fqn!r} at {list(chunk.offsets)}"
        if contents.result.unsafe_globals or not isinstance(t, TensorRef):
            raise CorruptCheckpointError(f"{what} does not hold a plain tensor", path=where)
        if t.dtype != item.dtype or t.shape != chunk.sizes:
            raise CorruptCheckpointError(
                f"{what} holds a {t.dtype} tensor of shape {list(t.shape)}, the metadata says "
                f"{item.dtype} {list(chunk.sizes)}",
                path=where,
            )
        record = contents.records[f"data/{t.storage.key}"]
        if record.compressed:
            raise CorruptCheckpointError(f"{what} has a compressed storage record", path=where)
        span = ByteSpan(where, chunk.offset + record.data_offset, t.storage.nbytes)
        return ChunkData(chunk, t, span, record.crc32)


def _read_archive(path: str, offset: int, length: int) -> ArchiveContents:
    fd = os.open(path, os.O_RDONLY)
    try:
        contents = read_torch_archive(path, FileSlice(fd, offset, length), length)
        refuse_big_endian(path, contents.byteorder, f"the item at offset {offset}")
        return contents
    except CorruptCheckpointError as e:
        raise type(e)(f"the item at offset {offset} ({length} bytes): {e}", path=path) from e
    finally:
        os.close(fd)


def _set_element(root: dict[Any, Any], path: tuple[str | int, ...], value: Any, where: str) -> None:
    """DCP's ``set_element``: str keys make dicts, int keys lists (grown with None)."""
    node: Any = root
    for i, key in enumerate(path):
        last = i == len(path) - 1
        new: Any = value if last else ({} if type(path[i + 1]) is str else [])
        if isinstance(node, dict) and type(key) is str:
            if last:
                if key in node:
                    raise CorruptCheckpointError(f"{where!r}: two items are placed at {path!r}")
                node[key] = value
            node = node.setdefault(key, new)
        elif isinstance(node, list) and type(key) is int:
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = new
            elif last:
                raise CorruptCheckpointError(f"{where!r}: two items are placed at {path!r}")
            node = node[key]
        else:
            raise CorruptCheckpointError(
                f"{where!r}: planner_data places an item at {path!r}, through a value that is "
                "not a container of that key's kind"
            )


def open_dcp(folder: str) -> DcpCheckpoint:
    """Open a DCP folder without torch: its metadata, its values, and where chunks lie.

    Args:
        folder: the folder ``torch.distributed.checkpoint.save`` wrote.

    Returns:
        A ``dcp`` :class:`DcpCheckpoint` whose root is the state dict as DCP nests it.

    Raises:
        CorruptCheckpointError: malformed metadata, or items that do not read.
        UnsupportedFormatError: compressed items, or non-strided tensors.
        UnsafeContentError: the metadata names globals outside DCP's classes.

    Example:
        >>> import warnings, torch, torch.distributed.checkpoint as dcp
        >>> with warnings.catch_warnings():  # (saving without a process group warns)
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"model": {"fc.w": torch.zeros(2, 3)}, "step": 5}, checkpoint_id="r")
        >>> ckpt = open_dcp("r")
        >>> ckpt.format, ckpt.root["step"], ckpt.root["model"]["fc.w"].shape
        ('dcp', 5, (2, 3))
    """
    meta = read_metadata(folder, METADATA_FILE)
    root: dict[Any, Any] = {}
    tensors: dict[int, DcpTensor] = {}
    storages: dict[str, StorageRef] = {}
    spans: dict[int, ByteSpan] = {}
    unsafe: dict[str, None] = {}
    for fqn, item in meta.items.items():
        if isinstance(item, DcpTensor):
            storage = StorageRef(
                key=fqn,
                dtype=item.dtype,
                numel=math.prod(item.shape),
                device="cpu",
                storage_type=storage_type_ref(item.dtype),
            )
            value: Any = TensorRef(
                storage,
                0,
                item.shape,
                contiguous_stride(item.shape),
                item.dtype,
                item.requires_grad,
            )
            tensors[id(value)] = item
            storages[fqn] = storage
        else:
            value = _read_value(folder, item, storages, spans, unsafe)
        _set_element(root, item.path, value, folder)

    def locate(storage: StorageRef) -> ByteSpan:
        if id(storage) in spans:
            return spans[id(storage)]
        raise needs_consolidating(folder, storage.key)

    return DcpCheckpoint(
        path=folder,
        format="dcp",
        root=root,
        storages=storages,
        unsafe_globals=tuple(unsafe),
        locate=locate,
        dcp=meta,
        tensors=tensors,
    )


def needs_consolidating(folder: str, tensor: str | None = None) -> UsageError:
    """The refusal for reading a DCP folder's tensors as a file's: the one reason and remedy.

    DCP writes each tensor, or each chunk of it, as its own ``torch.save`` archive inside
    the ``.distcp`` files, even when one process saved it whole; what reads a tensor's bytes
    from one place needs the folder consolidated into one file first.

    Args:
        folder: the DCP folder.
        tensor: the tensor being read, when one is.

    Returns:
        The :class:`~ckpt_tools.errors.UsageError` to raise (exit 2).

    Example:
        >>> err = needs_consolidating("run/step_100", "model.fc.weight")
        >>> "run `ckpt consolidate run/step_100 OUT.pt`" in str(err), err.exit_code
        (True, 2)
    """
    which = f" (reading {tensor!r})" if tensor is not None else ""
    return consolidate_first(
        folder,
        "is a torch.distributed.checkpoint folder, which stores each tensor (or each chunk "
        f"of it) as its own archive in its .distcp files{which}",
    )


def _read_value(
    folder: str,
    item: DcpBytes,
    storages: dict[str, StorageRef],
    spans: dict[int, ByteSpan],
    unsafe: dict[str, None],
) -> Any:
    """A BYTE_IO value: its archive's pickle, restricted; tensors inside it are located."""
    where = os.path.join(folder, item.file)
    contents = _read_archive(where, item.offset, item.length)
    unsafe.update(dict.fromkeys(contents.result.unsafe_globals))
    for key, storage in contents.result.storages.items():
        record = contents.records[f"data/{key}"]
        if record.compressed:
            raise CorruptCheckpointError(f"{where!r}: value {item.fqn!r} has a compressed record")
        storages[f"{item.fqn}:{key}"] = storage
        spans[id(storage)] = ByteSpan(where, item.offset + record.data_offset, storage.nbytes)
    return contents.result.root
