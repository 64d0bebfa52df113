"""Writing tensors as a safetensors file: the one safetensors writer, every plan's.

Each tensor's bytes come from a :class:`~ckpt_tools.io.writers.records.Record`: spans are
copied by the copy engine (back-to-back spans as one range, or the whole data section as
one range when the source layout is kept); DCP chunk pieces are copied or assembled; casts,
means and non-contiguous views are produced in bounded pieces. torch is never imported.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import SAFETENSORS_PACKED, TORCH_TO_SAFETENSORS
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.io.copy.layout import safetensors_data_start, safetensors_offsets
from ckpt_tools.io.tensor_bytes import OpenFiles
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import Record, tensor_bytes_record

# The checks live beside the writer; re-exported, as the plans import them from here.
from ckpt_tools.io.writers.safetensors_checks import (
    check_holdable,
    leave_out_extras,
    tensor_attributes,
    tied_names,
    unholdable_kind,
)
from ckpt_tools.io.writers.zipfile import Writeback, copy_range, pwrite_all

__all__ = [
    "SafetensorsEntry",
    "check_holdable",
    "copied_bytes",
    "leave_out_extras",
    "safetensors_header",
    "source_records",
    "tensor_attributes",
    "tied_names",
    "unholdable_kind",
    "write_safetensors",
]
_LARGE_DATA = 64 << 20
_LARGE_DATA_ALIGNMENT = 64 << 10


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor to write: its name and descriptor in ``source``.

    What safetensors cannot hold (a conjugate or negative view, a dtype it lacks, a reserved
    name) is refused for every entry at once, by
    :func:`~ckpt_tools.io.writers.safetensors_checks.check_holdable`.
    """

    name: str
    tensor: TensorRef


def write_safetensors(
    entries: Sequence[tuple[str, TensorRef, Record]],
    file: BinaryIO,
    metadata: Mapping[str, str] | None = None,
    counter: ByteCounter | None = None,
    *,
    durable: bool,
) -> None:
    """Write tensors as a safetensors file; each one's bytes come from its record.

    Spans back to back in one source are copied as one range. When every record is a span
    and together they tile one range of one file (every tensor of a safetensors source,
    renamed), the header is padded so the data lands at its source offset modulo 4096 and
    is copied in one range (:func:`~ckpt_tools.io.copy.layout.safetensors_offsets`).

    Args:
        entries: ``(name, output tensor, record)`` in the order they are written; each record
            holds exactly the tensor's bytes in row-major order.
        file: the output, opened ``w+b``.
        metadata: the header's ``__metadata__`` (string to string), if any.
        counter: told the byte count of every piece written.
        durable: whether the output will be fsynced (``AtomicFile.durable``).

    Raises:
        ConversionError: a tensor safetensors cannot hold (a dtype it lacks, a conjugate or
            negative view, a reserved name: :func:`check_holdable`), before a byte is written.
        OSError: reading or writing failed, or a producer yields the wrong byte count.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> entries = source_records([SafetensorsEntry(k, t) for k, t in ckpt.root.items()], ckpt)
        >>> with open("out.safetensors", "w+b") as f:
        ...     write_safetensors(entries, f, metadata={"format": "pt"}, durable=False)
        >>> out = open_checkpoint("out.safetensors")
        >>> out.format, list(out.root) == list(ckpt.root)
        ('safetensors', True)
    """
    spans = [(r.span.path, r.span.offset, r.nbytes) for _, _, r in entries if r.span is not None]
    kept = safetensors_offsets(spans) if len(spans) == len(entries) else None
    header = [SafetensorsEntry(name, t) for name, t, _ in entries]
    raw = safetensors_header(header, metadata, kept[1] if kept else None)
    fd = file.fileno()
    writeback = Writeback(fd, durable=durable)
    if kept is None:
        pwrite_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
        end = _write_records(entries, fd, 8 + len(raw), counter, writeback)
    else:
        # The tensors keep their source layout: the header is padded with spaces so the data
        # lands at its source offset (modulo 4096 at least), and is copied in one range.
        start = safetensors_data_start(8 + len(raw), kept[0])
        raw += b" " * (start - 8 - len(raw))
        pwrite_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
        size = sum(r.nbytes for _, _, r in entries)
        with open(spans[0][0], "rb") as src:
            copy_range(src.fileno(), kept[0], fd, start, size, counter, writeback)
        end = start + size
    os.ftruncate(fd, end)


def source_records(
    entries: Sequence[SafetensorsEntry], source: Checkpoint
) -> list[tuple[str, TensorRef, Record]]:
    """:func:`write_safetensors`' entries for tensors of ``source`` written as they are.

    Contiguous tensors are spans of the source; a non-contiguous view is gathered in
    row-major order, a bounded piece at a time
    (:func:`~ckpt_tools.io.writers.records.tensor_bytes_record`).
    """
    return [(e.name, e.tensor, tensor_bytes_record(source, e.tensor)) for e in entries]


def copied_bytes(entries: Sequence[SafetensorsEntry]) -> int:
    """The bytes :func:`source_records` copies as spans (contiguous tensors); the rest,
    non-contiguous views, is gathered."""
    return sum(e.tensor.nbytes for e in entries if e.tensor.is_contiguous())


def safetensors_header(
    entries: Sequence[SafetensorsEntry],
    metadata: Mapping[str, str] | None,
    offsets: Sequence[int] | None = None,
) -> bytes:
    """The JSON header, padded so the data starts aligned (unpadded with ``offsets`` given).

    Args:
        entries: the tensors, in the order their bytes follow the header.
        metadata: the ``__metadata__`` entry (string to string), if any, tied names
            recorded in it by :func:`~ckpt_tools.formats.safetensors.tie_metadata`.
        offsets: each tensor's data offset, where the source layout is kept; otherwise
            they lie back to back.

    Returns:
        The header bytes (the 8-byte length prefix is the caller's).

    Raises:
        ConversionError: a tensor safetensors cannot hold (:func:`check_holdable`).

    Example:
        >>> from ckpt_tools.descriptors import StorageRef, TensorRef
        >>> s = StorageRef("0", "float32", 2, "cpu")
        >>> w = TensorRef(storage=s, offset=0, shape=(2,), stride=(1,), dtype="float32")
        >>> safetensors_header([SafetensorsEntry("w", w)], None).rstrip()
        b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    """
    # The writer's guard: a plan that skipped the check is refused here, before any data.
    check_holdable([(e.name, e.tensor) for e in entries], None)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    position = 0
    for i, entry in enumerate(entries):
        t = entry.tensor
        if offsets is not None:
            position = offsets[i]
        shape = list(t.shape)
        if t.dtype in SAFETENSORS_PACKED:  # the header counts the elements packed in each
            shape[-1] *= SAFETENSORS_PACKED[t.dtype]
        header[entry.name] = {
            "dtype": TORCH_TO_SAFETENSORS[t.dtype],
            "shape": shape,
            "data_offsets": [position, position + t.nbytes],
        }
        position += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    if offsets is not None:
        return raw
    # safetensors pads the header with spaces so data starts 8-aligned; large files are
    # padded to 64 KiB, so kernel copies of the data move whole pages.
    align = _LARGE_DATA_ALIGNMENT if position >= _LARGE_DATA else 8
    return raw + b" " * ((-(8 + len(raw))) % align)


def _write_records(
    entries: Sequence[tuple[str, TensorRef, Record]],
    fd: int,
    start: int,
    counter: ByteCounter | None,
    writeback: Writeback,
) -> int:
    """Write every record back to back from ``start``; returns where they end."""
    out = start
    run: list[Any] = []  # [path, src_offset, dst_offset, nbytes]: one merged kernel copy
    with OpenFiles() as files:
        for name, _, record in entries:
            span = record.span
            if span is not None and run and run[0] == span.path and run[1] + run[3] == span.offset:
                run[3] += record.nbytes  # back to back in the source too: extend the copy
            elif span is not None:
                _flush(run, files, fd, counter, writeback)
                run = [span.path, span.offset, out, record.nbytes]
            else:
                _flush(run, files, fd, counter, writeback)
                run = []
                _write_made(name, record, fd, out, counter, writeback)
            out += record.nbytes
        _flush(run, files, fd, counter, writeback)
    return out


def _flush(
    run: list[Any],
    files: OpenFiles,
    fd: int,
    counter: ByteCounter | None,
    writeback: Writeback,
) -> None:
    if run and run[3]:
        path, src_offset, dst_offset, nbytes = run
        copy_range(files.fd(path), src_offset, fd, dst_offset, nbytes, counter, writeback)


def _write_made(
    name: str,
    record: Record,
    fd: int,
    out: int,
    counter: ByteCounter | None,
    writeback: Writeback,
) -> None:
    """Write a record that is not one span at ``out``: DCP chunk pieces, or produced bytes."""
    if record.produce is None:  # chunk pieces (none, for an empty tensor)
        from ckpt_tools.io.assemble import write_pieces

        write_pieces(fd, out, record.pieces, writeback, counter)
        return
    end = out + record.nbytes
    for piece in record.produce():
        if out + len(piece) > end:
            raise OSError(5, f"tensor {name!r} holds more than its {record.nbytes} bytes")
        pwrite_all(fd, piece, out)
        writeback.wrote(out, len(piece))
        out += len(piece)
        if counter is not None:
            counter(len(piece))
    if out != end:
        raise OSError(5, f"tensor {name!r} ended {end - out} bytes short")
