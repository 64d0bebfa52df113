"""Writing tensors as a safetensors file, their bytes copied from a source checkpoint.

Contiguous runs are copied in the kernel (``copy_file_range``, or one range when the source
layout is kept); non-contiguous views are gathered with numpy, a bounded piece at a time.
torch is never imported.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import TORCH_TO_SAFETENSORS
from ckpt_tools.errors import ConversionError, Remedy
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.io.copy.layout import kept_layout, safetensors_data_start
from ckpt_tools.io.tensor_bytes import OpenFiles, check_plain_values, iter_row_major
from ckpt_tools.io.writers.zipfile import Writeback, copy_range, pwrite_all

__all__ = ["SafetensorsEntry", "safetensors_header", "write_safetensors"]

Progress = Callable[[int], None]
_LARGE_DATA = 64 << 20
_LARGE_DATA_ALIGNMENT = 64 << 10


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor to write: its name and descriptor in ``source``.

    Raises:
        ConversionError: the tensor is a conjugate or negative view, whose bit the format
            cannot hold (:func:`~ckpt_tools.io.tensor_bytes.check_plain_values`).
    """

    name: str
    tensor: TensorRef

    def __post_init__(self) -> None:
        check_plain_values(self.name, self.tensor, "a safetensors file")


def write_safetensors(
    entries: Sequence[SafetensorsEntry],
    source: Checkpoint,
    file: BinaryIO,
    metadata: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    *,
    durable: bool,
) -> None:
    """Write tensors as a safetensors file, copying their bytes from ``source``.

    Contiguous tensors (whole storages or contiguous slices of one) are copied in the
    kernel; non-contiguous views are gathered with numpy, one bounded piece at a time
    (:func:`~ckpt_tools.io.tensor_bytes.iter_row_major`). torch is never imported.

    Args:
        entries: the tensors, in the order their bytes are written.
        source: the checkpoint their storages live in.
        file: the output, opened ``w+b``.
        metadata: the header's ``__metadata__`` (string to string), if any.
        progress: called with the number of bytes written after each chunk.
        durable: whether the output will be fsynced (``AtomicFile.durable``).

    Raises:
        ConversionError: a dtype safetensors cannot hold (quantized types, complex32 ...).
        OSError: reading or writing failed.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> entries = [SafetensorsEntry(k, t) for k, t in ckpt.root.items()]
        >>> with open("out.safetensors", "w+b") as f:
        ...     write_safetensors(entries, ckpt, f, metadata={"format": "pt"}, durable=False)
        >>> out = open_checkpoint("out.safetensors")
        >>> out.format, list(out.root) == list(ckpt.root)
        ('safetensors', True)
    """
    kept = kept_layout([e.tensor for e in entries], source)
    raw = safetensors_header(entries, metadata, kept[1] if kept else None)
    fd = file.fileno()
    writeback = Writeback(fd, durable=durable)
    if kept is None:
        pwrite_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
        end = _write_tensor_bytes(entries, source, fd, 8 + len(raw), progress, writeback)
    else:
        # The tensors keep their source layout: the header is padded with spaces so the data
        # lands at its source offset (modulo 4096 at least), and is copied in one range.
        start = safetensors_data_start(8 + len(raw), kept[0])
        raw += b" " * (start - 8 - len(raw))
        pwrite_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
        size = sum(e.tensor.nbytes for e in entries)
        with open(source.span(entries[0].tensor.storage).path, "rb") as src:
            copy_range(src.fileno(), kept[0], fd, start, size, progress, writeback)
        end = start + size
    os.ftruncate(fd, end)


def safetensors_header(
    entries: Sequence[SafetensorsEntry],
    metadata: Mapping[str, str] | None,
    offsets: Sequence[int] | None = None,
) -> bytes:
    """The JSON header, padded so the data starts aligned (unpadded with ``offsets`` given).

    Args:
        entries: the tensors, in the order their bytes follow the header.
        metadata: the ``__metadata__`` entry (string to string), if any.
        offsets: each tensor's data offset, where the source layout is kept; otherwise
            they lie back to back.

    Returns:
        The header bytes (the 8-byte length prefix is the caller's).

    Raises:
        ConversionError: a dtype safetensors cannot hold.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef, TensorRef
        >>> s = StorageRef("0", "float32", 2, "cpu")
        >>> w = TensorRef(storage=s, offset=0, shape=(2,), stride=(1,), dtype="float32")
        >>> safetensors_header([SafetensorsEntry("w", w)], None).rstrip()
        b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    position = 0
    for i, entry in enumerate(entries):
        t = entry.tensor
        if offsets is not None:
            position = offsets[i]
        code = TORCH_TO_SAFETENSORS.get(t.dtype)
        if code is None:
            raise ConversionError(
                f"tensor {entry.name!r} has dtype {t.dtype}, which safetensors cannot hold",
                remedies=(
                    Remedy(
                        "format",
                        "'torch'",
                        flag="--format torch",
                        text="to keep it in torch format",
                    ),
                ),
            )
        header[entry.name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [position, position + t.nbytes],
        }
        position += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    if offsets is not None:
        return raw
    # safetensors pads the header with spaces so data starts 8-aligned; for large files we
    # pad to 64 KiB, so the kernel copy fills whole large page-cache folios (measurably faster).
    align = _LARGE_DATA_ALIGNMENT if position >= _LARGE_DATA else 8
    return raw + b" " * ((-(8 + len(raw))) % align)


def _write_tensor_bytes(
    entries: Sequence[SafetensorsEntry],
    source: Checkpoint,
    fd: int,
    start: int,
    progress: Progress | None,
    writeback: Writeback,
) -> int:
    """Write every entry's bytes back to back from ``start``; returns where they end."""
    files = OpenFiles()
    source_fd = files.fd
    try:
        out = start
        run: list[Any] = []  # [path, src_offset, dst_offset, nbytes]: one merged kernel copy
        for entry in entries:
            t = entry.tensor
            span = source.span(t.storage)
            first = span.offset + t.byte_span[0]
            if not t.is_contiguous():
                _flush(run, source_fd, fd, progress, writeback)
                run = []
                _write_gathered(source_fd(span.path), span.offset, t, fd, out, progress, writeback)
            elif run and run[0] == span.path and run[1] + run[3] == first:
                run[3] += t.nbytes  # back to back in the source too: extend the copy
            else:
                _flush(run, source_fd, fd, progress, writeback)
                run = [span.path, first, out, t.nbytes]
            out += t.nbytes
        _flush(run, source_fd, fd, progress, writeback)
    finally:
        files.close()
    return out


def _flush(
    run: list[Any],
    source_fd: Callable[[str], int],
    fd: int,
    progress: Progress | None,
    writeback: Writeback,
) -> None:
    if run and run[3]:
        path, src_offset, dst_offset, nbytes = run
        copy_range(source_fd(path), src_offset, fd, dst_offset, nbytes, progress, writeback)


def _write_gathered(
    src_fd: int,
    storage_offset: int,
    t: TensorRef,
    fd: int,
    out: int,
    progress: Progress | None,
    writeback: Writeback,
) -> None:
    """Write a non-contiguous view's elements in row-major order at ``out``, piece by piece."""
    for piece in iter_row_major(src_fd, storage_offset, t):
        pwrite_all(fd, piece, out)
        writeback.wrote(out, len(piece))
        out += len(piece)
        if progress is not None:
            progress(len(piece))
