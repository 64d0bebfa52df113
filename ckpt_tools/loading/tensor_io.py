"""Reading one tensor's bytes from a checkpoint file into torch, without loading the rest.

The torch-free layer says where each storage lies (:meth:`Checkpoint.span`); this module
reads just the bytes a tensor view covers with ``os.pread`` into a fresh buffer and builds
the tensor over it. Nothing is memory-mapped (mapped pages count in RSS) and nothing else
of the file is read, so comparing two large checkpoints tensor by tensor stays in bounded
memory. :func:`iter_chunks` goes further and streams a tensor as flat pieces.

A checkpoint read from a URL (its ``remote`` files) is read the same way, each range fetched
in requests of at most :data:`~ckpt_tools.io.remote.rangefile.STREAM_CHUNK` bytes: only the
tensors asked for travel.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Iterator

import torch

from ckpt_tools.descriptors import ByteSpan, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats import Checkpoint
from ckpt_tools.formats.base import RangeSource
from ckpt_tools.io.ranges import SourceEndedError, pread_chunks
from ckpt_tools.io.remote.rangefile import STREAM_CHUNK
from ckpt_tools.io.tensor_bytes import ClosesOnExit, OpenFiles, pread_exact

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "TensorReader",
    "dtype_name",
    "flat_pieces",
    "iter_chunks",
    "read_tensor",
    "torch_dtype",
]

#: Bytes per piece :func:`iter_chunks` yields by default.
DEFAULT_CHUNK_BYTES = 4 << 20

# Quantized and packed dtypes are read as their integer representation.
_RAW_DTYPES = {
    "qint8": "int8",
    "quint8": "uint8",
    "qint32": "int32",
    "quint4x2": "uint8",
    "quint2x4": "uint8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: torch's name without the prefix (the inverse of
    :func:`torch_dtype`)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a tensor of dtype ``name`` is read as.

    Quantized dtypes map to their integer representation (``qint8`` -> ``torch.int8``).

    Raises:
        UnsupportedFormatError: this torch has no such dtype.

    Example:
        >>> torch_dtype("bfloat16")
        torch.bfloat16
    """
    dtype = getattr(torch, _RAW_DTYPES.get(name, name), None)
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedFormatError(
            f"dtype {name!r} is not known to torch {torch.__version__}; upgrade torch to read it"
        )
    return dtype


class TensorReader(ClosesOnExit):
    """Reads tensors of one opened checkpoint, keeping one file descriptor per file.

    Use it as a context manager (or call :meth:`close`) so the descriptors are released.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> with TensorReader(ckpt) as reader:
        ...     weights = [reader.read(ckpt.root[k]) for k in ("conv.weight", "head.weight")]
        >>> [tuple(w.shape) for w in weights]
        [(8, 3, 3, 3), (3, 8)]
    """

    def __init__(self, ckpt: Checkpoint) -> None:
        if sys.byteorder != "little":
            raise UnsupportedFormatError(
                "checkpoint bytes are little-endian; reading them on a big-endian host is "
                "not supported"
            )
        self.ckpt = ckpt
        self._files = OpenFiles()
        # Files whose storages torch.load byte-swaps (a big-endian torch zip).
        self._swapped = {c.path for c in (ckpt, *ckpt.shards.values()) if c.byteorder == "big"}

    def close(self) -> None:
        """Close every file descriptor this reader opened."""
        self._files.close()

    def read_bytes(self, ref: TensorRef, start: int, nbytes: int) -> bytearray:
        """``nbytes`` bytes of ``ref``'s storage starting ``start`` bytes into it, in this
        host's byte order (a big-endian file's swapped by the storage's dtype, as torch.load
        swaps them).

        Raises:
            CorruptCheckpointError: the range lies outside the storage, or the file ends early.
        """
        span = self.ckpt.span(ref.storage)
        if start < 0 or start + nbytes > span.nbytes:
            raise CorruptCheckpointError(
                f"{span.path!r}: tensor bytes [{start}, {start + nbytes}) lie outside storage "
                f"{ref.storage.key!r} of {span.nbytes} bytes"
            )
        if span.path not in self._swapped:
            return self._read_span(span, ref, start, nbytes)
        # Whole storage elements are read and swapped, then the range cut out of them.
        dtype = torch_dtype(ref.storage.dtype)
        size = itemsize(ref.storage.dtype)
        first, end = start - start % size, min(-(-(start + nbytes) // size) * size, span.nbytes)
        buffer = self._read_span(span, ref, first, end - first)
        if buffer:
            torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage().byteswap(dtype)
        return buffer[start - first : start - first + nbytes]

    def _read_span(self, span: ByteSpan, ref: TensorRef, start: int, nbytes: int) -> bytearray:
        source = self.ckpt.remote.get(span.path)
        if source is not None:
            return _fetch(source, span, start, nbytes, ref.storage.key)
        try:
            return pread_exact(self._files.fd(span.path), nbytes, span.offset + start)
        except OSError as e:
            if e.errno != errno.EIO:
                raise
            raise CorruptCheckpointError(
                f"{span.path!r} ends before storage {ref.storage.key!r} does (needed "
                f"{nbytes} bytes at offset {span.offset + start}); the file is truncated"
            ) from e

    def read(self, ref: TensorRef) -> torch.Tensor:
        """The tensor ``ref`` describes, on the CPU, in a fresh buffer of its own.

        Only the storage range the view covers is read; strides are respected. A view
        covering much more storage than it uses is copied out compactly.
        """
        dtype = torch_dtype(ref.dtype)
        if ref.numel == 0:
            return torch.empty(ref.shape, dtype=dtype)
        first, end = ref.byte_span
        buffer = self.read_bytes(ref, first, end - first)
        flat = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
        tensor = flat.as_strided(ref.shape, ref.stride, 0)
        return tensor.clone() if end - first > 2 * ref.nbytes else tensor

    def chunks(
        self, ref: TensorRef, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[torch.Tensor]:
        """``ref``'s elements in row-major order as flat CPU tensors of about ``chunk_bytes``.

        A contiguous tensor is read piece by piece; any other has its storage's span read
        once, then is walked in pieces (:func:`flat_pieces`). A remote one is fetched
        :data:`~ckpt_tools.io.remote.rangefile.STREAM_CHUNK` bytes at a time (fewer, larger
        requests), then sliced.
        """
        dtype = torch_dtype(ref.dtype)
        size = itemsize(ref.dtype)
        step = max(1, chunk_bytes // size)
        if not ref.is_contiguous():
            yield from flat_pieces(self.read(ref), step)
            return
        per_read = max(step, STREAM_CHUNK // size) if self.ckpt.remote else step
        for start in range(0, ref.numel, per_read):
            count = min(per_read, ref.numel - start)
            buffer = self.read_bytes(ref, ref.byte_offset + start * size, count * size)
            flat = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype)
            for at in range(0, count, step):
                yield flat[at : at + step]


def flat_pieces(tensor: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    """``tensor``'s elements in row-major order, ``step`` at a time (the last piece fewer),
    each piece a flat copy of its own elements only.

    A view is never made whole: an expanded one (stride 0) can stand for far more elements
    than its storage holds, and ``reshape(-1)`` would allocate every one of them.

    Example:
        >>> t = torch.arange(3.0).expand(4, 3)
        >>> [p.tolist() for p in flat_pieces(t, 5)]
        [[0.0, 1.0, 2.0, 0.0, 1.0], [2.0, 0.0, 1.0, 2.0, 0.0], [1.0, 2.0]]
    """
    pending: list[torch.Tensor] = []
    held = 0
    for piece in _row_blocks(tensor, step):
        pending.append(piece)
        held += piece.numel()
        while held >= step:
            joined = torch.cat(pending) if len(pending) > 1 else pending[0]
            yield joined[:step]
            rest = joined[step:]
            pending, held = ([rest] if rest.numel() else []), rest.numel()
    if held:
        yield torch.cat(pending) if len(pending) > 1 else pending[0]


def _row_blocks(tensor: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    """Flat copies of ``tensor``'s leading rows, at most about ``step`` elements each (a
    row larger than that is split along its own rows)."""
    if tensor.is_contiguous() or tensor.dim() == 0:
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]
        return
    if tensor.dim() == 1:
        for start in range(0, tensor.numel(), step):
            yield tensor[start : start + step].contiguous()
        return
    row = tensor[0].numel() if tensor.shape[0] else 0
    if row > step:
        for i in range(tensor.shape[0]):
            yield from _row_blocks(tensor[i], step)
        return
    rows = max(1, step // max(row, 1))
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start : start + rows].reshape(-1)


def _fetch(source: RangeSource, span: ByteSpan, start: int, nbytes: int, key: str) -> bytearray:
    """``nbytes`` bytes ``start`` bytes into a remote span, in bounded requests."""
    buffer = bytearray()
    try:
        for piece in pread_chunks(source.pread, span.offset + start, nbytes, chunk=STREAM_CHUNK):
            buffer += piece
    except SourceEndedError as e:
        raise CorruptCheckpointError(
            f"{span.path!r} ends before storage {key!r} does (needed {nbytes} bytes at "
            f"offset {span.offset + start}); the remote file is truncated or changed",
            path=span.path,
        ) from e
    return buffer


def read_tensor(ckpt: Checkpoint, ref: TensorRef) -> torch.Tensor:
    """Read one tensor of an opened checkpoint into a fresh CPU tensor.

    Args:
        ckpt: the checkpoint (any format whose storages have byte locations).
        ref: one of its tensor descriptors.

    Returns:
        The tensor, with the saved shape, strides and dtype (quantized dtypes as their
        integer representation). It owns its memory; the file is not mapped.

    Raises:
        CorruptCheckpointError: the file ends before the tensor's bytes do.
        UnsupportedFormatError: the dtype is unknown to this torch.
        KeyError: the checkpoint has no byte locations (plain pickles).

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> read_tensor(ckpt, ckpt.root["head.weight"]).shape
        torch.Size([3, 8])
    """
    with TensorReader(ckpt) as reader:
        return reader.read(ref)


def iter_chunks(
    ckpt: Checkpoint, ref: TensorRef, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[torch.Tensor]:
    """Stream one tensor as flat CPU pieces of about ``chunk_bytes`` (:meth:`TensorReader.chunks`).

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> ref = ckpt.root["conv.weight"]  # 216 float32 elements, 864 bytes
        >>> [c.numel() for c in iter_chunks(ckpt, ref, chunk_bytes=256)]
        [64, 64, 64, 24]
    """
    with TensorReader(ckpt) as reader:
        yield from reader.chunks(ref, chunk_bytes)
