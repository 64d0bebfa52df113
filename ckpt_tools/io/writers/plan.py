"""Writing a transform plan: each output storage copied from a source, or streamed by a producer.

The transforms (slim, extract, average) make new storages: a cast storage, a mean of N inputs.
A :class:`Record` says where one output storage's bytes come from; the one zip writer
(:class:`~ckpt_tools.io.writers.zipfile.TorchZipWriter`, ``add_copy`` / ``add_stream``) and the
safetensors header of :mod:`~ckpt_tools.io.writers.safetensors` write them, piece by piece,
so memory does not grow with the file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef
from ckpt_tools.errors import ConversionError
from ckpt_tools.formats.pickle.repickle import TORCH_PICKLE_PROTOCOL, dumps, torch_storage_id
from ckpt_tools.io.tensor_bytes import OpenFiles
from ckpt_tools.io.writers.safetensors import SafetensorsEntry, safetensors_header
from ckpt_tools.io.writers.zipfile import (
    SAVE_HEAD_RECORDS,
    SAVE_VERSION,
    TorchZipWriter,
    Writeback,
    copy_range,
    pwrite_all,
)

__all__ = [
    "Record",
    "record_bytes",
    "same_record_bytes",
    "write_plan_safetensors",
    "write_plan_zip",
]

Progress = Callable[[int], None]


@dataclass(frozen=True)
class Record:
    """Where one output record's bytes come from: a source span, or a producer of chunks.

    Attributes:
        nbytes: the record's size.
        span: bytes to copy as they are (``copy_file_range``), or None.
        crc32: the span's CRC-32 when known (a whole zip record), so it is not recomputed.
        produce: called once when the record is written; yields its bytes in bounded chunks.
        action: what makes it, in words (``copy``, ``cast float32 -> bfloat16``, ``mean of 3``).
    """

    nbytes: int
    span: ByteSpan | None = None
    crc32: int | None = None
    produce: Callable[[], Iterable[bytes]] | None = None
    action: str = "copy"


def write_plan_zip(
    tree: Any,
    records: Mapping[int, Record],
    file: BinaryIO,
    root: str = "archive",
    progress: Progress | None = None,
    *,
    durable: bool,
) -> list[StorageRef]:
    """Write ``tree`` as a torch zip archive; each storage's bytes come from ``records``.

    Args:
        tree: the output object tree (its tensors' storages are the output storages).
        records: ``id(storage)`` -> :class:`Record` for every storage in ``tree``.
        file: the output, opened ``w+b``.
        root: the archive's root folder name.
        progress: called with the number of tensor bytes written after each chunk.
        durable: whether the output will be fsynced (``AtomicFile.durable``).

    Returns:
        The storages written, in order (named ``data/0``, ``data/1``, ... as torch.save does).

    Raises:
        ConversionError: a storage without a record (a planning bug, caught before writing).
        OSError: reading a source or writing failed.
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
    writer.add_bytes("data.pkl", payload)
    for head, value in SAVE_HEAD_RECORDS:
        writer.add_bytes(head, value)
    with OpenFiles() as files:
        for storage in used:
            name, record = f"data/{keys[id(storage)]}", records[id(storage)]
            if record.span is not None:
                fd = files.fd(record.span.path)
                writer.add_copy(name, fd, record.span.offset, record.nbytes, record.crc32, progress)
            elif record.produce is not None:
                writer.add_stream(name, record.produce(), record.nbytes, progress)
        writer.add_bytes(*SAVE_VERSION)
        import uuid

        writer.add_bytes(".data/serialization_id", str(uuid.uuid4().int)[:20].encode())
        writer.close()
    return used


def write_plan_safetensors(
    entries: Sequence[tuple[str, TensorRef, Record]],
    file: BinaryIO,
    metadata: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    *,
    durable: bool,
) -> None:
    """Write tensors as a safetensors file; each one's (contiguous) bytes come from its record.

    Args:
        entries: ``(name, output tensor, record)`` in the order they are written; each record
            holds exactly the tensor's bytes in row-major order.
        file: the output, opened ``w+b``.
        metadata: the header's ``__metadata__``.
        progress: called with the number of bytes written after each chunk.
        durable: whether the output will be fsynced (``AtomicFile.durable``).

    Raises:
        ConversionError: a dtype safetensors cannot hold.
        OSError: reading or writing failed, or a producer yields the wrong byte count.
    """
    raw = safetensors_header([SafetensorsEntry(name, t) for name, t, _ in entries], metadata)
    fd_out = file.fileno()
    pwrite_all(fd_out, struct.pack("<Q", len(raw)) + raw, 0)
    out = 8 + len(raw)
    writeback = Writeback(fd_out, durable=durable)
    with OpenFiles() as files:
        for name, _, record in entries:
            end = out + record.nbytes
            if record.span is not None:  # copied in the kernel, as every other writer does
                src = files.fd(record.span.path)
                copy_range(src, record.span.offset, fd_out, out, record.nbytes, progress, writeback)
                out = end
                continue
            assert record.produce is not None
            for piece in record.produce():
                if out + len(piece) > end:
                    raise OSError(5, f"tensor {name!r} holds more than its {record.nbytes} bytes")
                pwrite_all(fd_out, piece, out)
                writeback.wrote(out, len(piece))
                out += len(piece)
                if progress is not None:
                    progress(len(piece))
            if out != end:
                raise OSError(5, f"tensor {name!r} ended {end - out} bytes short")
    os.ftruncate(fd_out, out)


def _span_chunks(fd: int, span: ByteSpan, chunk: int = 8 << 20) -> Iterable[bytes]:
    done = 0
    while done < span.nbytes:
        data = os.pread(fd, min(chunk, span.nbytes - done), span.offset + done)
        if not data:
            raise OSError(5, f"source ended after {done} of {span.nbytes} bytes")
        yield data
        done += len(data)


def record_bytes(record: Record) -> Iterable[bytes]:
    """The bytes ``record`` stands for, in bounded chunks (a producer runs again)."""
    if record.produce is not None:
        yield from record.produce()
        return
    assert record.span is not None
    fd = os.open(record.span.path, os.O_RDONLY)
    try:
        yield from _span_chunks(fd, record.span)
    finally:
        os.close(fd)


def same_record_bytes(path: str, start: int, record: Record) -> bool:
    """Whether ``path`` holds ``record``'s bytes at ``start`` (``verify="full"``).

    Computed records are computed again, copied ones read again from their source, and both
    hashed against the written bytes, one chunk at a time.
    """
    import hashlib

    want = hashlib.blake2b(digest_size=16)
    for piece in record_bytes(record):
        want.update(piece)
    have = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        f.seek(start)
        left = record.nbytes
        while left:
            piece = f.read(min(8 << 20, left))
            if not piece:
                return False
            have.update(piece)
            left -= len(piece)
    return want.digest() == have.digest()
