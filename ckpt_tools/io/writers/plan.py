"""Writing a planned torch zip archive: each output storage a record, copied or produced.

The transforms (slim, extract, average) and ``consolidate`` make new storages: a cast
storage, a mean of N inputs, a tensor assembled from DCP chunks. Their plan is an object
tree and one :class:`~ckpt_tools.io.writers.records.Record` per output storage, written here
as ``torch.save`` lays its archive out, piece by piece, so memory does not grow with the
file. (Safetensors plans are written by :mod:`ckpt_tools.io.writers.safetensors`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, BinaryIO

from ckpt_tools.descriptors import StorageRef
from ckpt_tools.errors import ConversionError
from ckpt_tools.formats.pickle.repickle import TORCH_PICKLE_PROTOCOL, dumps, torch_storage_id
from ckpt_tools.io.tensor_bytes import OpenFiles
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import Record
from ckpt_tools.io.writers.torchzip import write_save_layout
from ckpt_tools.io.writers.zipfile import TorchZipWriter, Writeback

__all__ = ["write_plan_zip"]


def write_plan_zip(
    tree: Any,
    records: Mapping[int, Record],
    file: BinaryIO,
    root: str = "archive",
    counter: ByteCounter | None = None,
    *,
    durable: bool,
) -> list[StorageRef]:
    """Write ``tree`` as a torch zip archive; each storage's bytes come from ``records``.

    Args:
        tree: the output object tree (its tensors' storages are the output storages).
        records: ``id(storage)`` -> :class:`~ckpt_tools.io.writers.records.Record` for every
            storage in ``tree``.
        file: the output, opened ``w+b``.
        root: the archive's root folder name.
        counter: told the byte count of every piece of tensor data written.
        durable: whether the output will be fsynced (``AtomicFile.durable``).

    Returns:
        The storages written, in order (named ``data/0``, ``data/1``, ... as torch.save does).

    Raises:
        ConversionError: a storage without a record (a planning bug, caught before writing).
        OSError: reading a source or writing failed, or a producer yields the wrong byte count.
    """
    keys: dict[int, str] = {}
    used: list[StorageRef] = []

    def storage_id(storage: StorageRef) -> tuple[Any, ...]:
        if id(storage) not in records:
            raise ConversionError(f"storage {storage.key!r} has no planned record")
        if id(storage) not in keys:
            keys[id(storage)] = str(len(keys))
            used.append(storage)
        return torch_storage_id(storage, keys[id(storage)], storage.device)

    payload = dumps(tree, TORCH_PICKLE_PROTOCOL, storage_id)
    writer = TorchZipWriter(file, root, durable=durable)
    with OpenFiles() as files:

        def add_storages() -> None:
            for storage in used:
                name = f"data/{keys[id(storage)]}"
                _add_record(writer, name, records[id(storage)], files, counter)

        write_save_layout(writer, payload, add_storages)
    return used


def _add_record(
    writer: TorchZipWriter,
    name: str,
    record: Record,
    files: OpenFiles,
    counter: ByteCounter | None,
) -> None:
    """One storage record: a span copied, chunk pieces copied or assembled, or produced."""
    if record.span is not None:
        fd = files.fd(record.span.path)
        writer.add_copy(name, fd, record.span.offset, record.nbytes, record.crc32, counter)
    elif record.produce is None:  # chunk pieces (none, for an empty tensor)
        from ckpt_tools.io.assemble import write_pieces

        def fill(fd: int, at: int, writeback: Writeback) -> int:
            return write_pieces(fd, at, record.pieces, writeback, counter)

        writer.add_written(name, record.nbytes, fill)
    else:
        writer.add_stream(name, record.produce(), record.nbytes, counter)
