"""A tensor's elements as bytes in row-major order, read from its storage, torch-free.

A contiguous tensor's bytes are one run of its storage. Any other view (transposed,
strided, expanded) is gathered with numpy: the storage bytes the view spans are read with
``pread`` (in parts of at most :data:`MAX_GATHER_SPAN` where splitting the view along its
first dimension shrinks them), an ``as_strided`` array over them walks the view, and its
elements are copied out in pieces of at most ``chunk_bytes``, so no copy of the whole
(possibly expanded) tensor is ever held. Bytes are
copied, never interpreted: no dtype conversion, no byte order question.
"""

from __future__ import annotations

import contextlib
import errno
import os
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import ConversionError, CorruptCheckpointError, Remedy
from ckpt_tools.formats.base import Checkpoint, open_buffered
from ckpt_tools.io.ranges import SourceEndedError

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations are never evaluated at run time

    import numpy as np

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ClosesOnExit",
    "OpenFiles",
    "check_plain_values",
    "decompressed",
    "iter_row_major",
    "pread_exact",
]

#: Largest piece :func:`iter_row_major` yields by default.
DEFAULT_CHUNK_BYTES = 8 << 20
#: The most storage bytes one gather of a strided view reads at once, where splitting the
#: view along its first dimension can keep it there.
MAX_GATHER_SPAN = 64 << 20
# One pread call reads at most this much (Linux caps a single read near 2 GiB).
_MAX_READ = 1 << 30


def check_plain_values(name: str, tensor: TensorRef, doing: str) -> None:
    """Refuse to take ``tensor``'s bytes as its values when torch would not.

    A conjugate or negative view is saved as its storage's bytes plus a bit that torch
    applies on loading (:attr:`TensorRef.view_bits`); a safetensors file, a cast or a mean
    of those bytes would silently drop the bit and change the values.

    Args:
        name: the tensor's key, for the message.
        tensor: its descriptor.
        doing: what would take the bytes as values (``"a mean"``, ``"a cast to bfloat16"``).

    Raises:
        ConversionError: the tensor carries a view bit.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> ref = TensorRef(StorageRef("0", "float32", 1, "cpu"), 0, (1,), (1,), "float32")
        >>> check_plain_values("w", ref, "a safetensors output")
    """
    bits = sorted(tensor.view_bits)
    if bits:
        what = " and ".join({"conj": "conjugate", "neg": "negative"}[b] for b in bits)
        resolve = ".".join(f"resolve_{b}()" for b in bits)
        raise ConversionError(
            f"tensor {name!r} is saved as a {what} view: torch.load applies the bit to its "
            f"bytes, which {doing} would take as they are, changing its values",
            # A cast or a mean drops the bit in any output format: only resolving it helps.
            remedies=(Remedy(text=f"load it, call .{resolve} and save that"),),
        )


class ClosesOnExit:
    """A context manager whose exit calls ``close()``: readers holding descriptors."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OpenFiles(ClosesOnExit):
    """Read-only file descriptors, one per path, opened on first use and closed together.

    Readers and writers that pull bytes from several files (shards, several inputs) keep
    one of these instead of reopening a file per tensor.

    Example:
        >>> with open("letters.bin", "wb") as f:
        ...     _ = f.write(b"abcdef")
        >>> with OpenFiles() as files:
        ...     pread_exact(files.fd("letters.bin"), 2, 1), files.fd("letters.bin") >= 0
        (bytearray(b'bc'), True)
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        """The descriptor of ``path``, opened read-only the first time it is asked for."""
        found = self._fds.get(path)
        if found is None:
            found = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        return found

    def close(self) -> None:
        """Close every descriptor opened so far (more may be opened afterwards)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def pread_exact(fd: int, nbytes: int, offset: int) -> bytearray:
    """Read exactly ``nbytes`` at ``offset`` of ``fd`` into a fresh buffer.

    Args:
        fd: an open file descriptor.
        nbytes: how many bytes to read.
        offset: where to start, from the start of the file.

    Returns:
        The bytes, in a buffer of their own.

    Raises:
        OSError: the read failed.
        SourceEndedError: the file ends first (an ``OSError`` with ``EIO``).

    Example:
        >>> with open("letters.bin", "wb") as f:
        ...     _ = f.write(b"abcdef")
        >>> fd = os.open("letters.bin", os.O_RDONLY)
        >>> pread_exact(fd, 3, 2)
        bytearray(b'cde')
        >>> pread_exact(fd, 4, 4)
        Traceback (most recent call last):
        ...
        ckpt_tools.io.ranges.SourceEndedError: [Errno 5] source ended after 2 of 4 bytes
        >>> os.close(fd)
    """
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        if got <= 0:
            raise SourceEndedError(done, nbytes)
        done += got
    return buffer


def iter_row_major(
    fd: int, storage_offset: int, tensor: TensorRef, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes | bytearray]:
    """Yield ``tensor``'s elements in row-major order, as ``tensor.contiguous()`` holds them.

    Args:
        fd: the file the tensor's storage lies in, open for reading.
        storage_offset: where the storage's bytes start in that file (``ByteSpan.offset``).
        tensor: the view to read.
        chunk_bytes: the most bytes one piece holds (a piece never splits an element).

    Returns:
        An iterator of pieces whose concatenation is the tensor's ``nbytes`` bytes; nothing
        for a tensor without elements.

    Raises:
        OSError: the read failed or the file ends before the storage does.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> with open("grid.bin", "wb") as f:
        ...     _ = f.write(b"abcdef")  # a 2x3 uint8 storage: rows abc, def
        >>> grid = StorageRef("0", "uint8", 6, "cpu")
        >>> rows = TensorRef(grid, offset=0, shape=(2, 3), stride=(3, 1), dtype="uint8")
        >>> columns = TensorRef(grid, offset=0, shape=(3, 2), stride=(1, 3), dtype="uint8")
        >>> fd = os.open("grid.bin", os.O_RDONLY)
        >>> list(iter_row_major(fd, 0, rows)), list(iter_row_major(fd, 0, columns, chunk_bytes=2))
        ([bytearray(b'abcdef')], [b'ad', b'be', b'cf'])
        >>> os.close(fd)
    """
    if tensor.numel == 0:
        return
    first, end = tensor.byte_span
    size = itemsize(tensor.dtype)
    if tensor.is_contiguous():
        step = max(size, chunk_bytes - chunk_bytes % size)
        for start in range(first, end, step):
            yield pread_exact(fd, min(step, end - start), storage_offset + start)
        return
    yield from _gather(
        fd, storage_offset, size, tensor.offset, tensor.shape, tensor.stride, chunk_bytes
    )


def _span(size: int, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Bytes from a view's first element to the end of its last (every dimension non-empty)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * size


def _gather(
    fd: int,
    base: int,
    size: int,
    offset: int,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    chunk_bytes: int,
) -> Iterator[bytes]:
    """Row-major pieces of a strided view, reading at most ``MAX_GATHER_SPAN`` bytes at once.

    A view whose storage span is larger is split along its first dimension, while that
    shrinks the span (a strided slice of a large storage); when it does not (a transposed
    view, whose every row touches the whole span), the span is read once, as splitting would
    read it again for every piece.
    """
    span = _span(size, offset, shape, stride)
    if span > MAX_GATHER_SPAN and shape:
        rows = shape[0]
        if rows == 1:
            yield from _gather(fd, base, size, offset, shape[1:], stride[1:], chunk_bytes)
            return
        half = (rows // 2, *shape[1:])
        if _span(size, offset, half, stride) * 4 <= span * 3:
            rest = (rows - rows // 2, *shape[1:])
            yield from _gather(fd, base, size, offset, half, stride, chunk_bytes)
            later = offset + (rows // 2) * stride[0]
            yield from _gather(fd, base, size, later, rest, stride, chunk_bytes)
            return
    import numpy as np  # only non-contiguous views need it

    # Elements as opaque ``size``-byte values (numpy's void type): any dtype, bf16 and float8
    # included, is copied as it is, never converted.
    element = np.dtype(f"V{size}")
    raw = np.frombuffer(pread_exact(fd, span, base + offset * size), dtype=element)
    view = np.lib.stride_tricks.as_strided(
        raw, shape=shape, strides=tuple(s * size for s in stride), writeable=False
    )
    yield from _pieces(view, max(chunk_bytes, size))


def _pieces(view: np.ndarray, limit: int) -> Iterator[bytes]:
    """Row-major copies of ``view`` of at most ``limit`` bytes each (one element at least)."""
    if view.nbytes <= limit:
        yield view.tobytes()
        return
    row = view.nbytes // len(view)  # not 0-d: one element is at most ``limit``
    if row > limit:
        # One row is already too big: split each row along the next axis.
        for sub in view:
            yield from _pieces(sub, limit)
        return
    step = limit // row
    for start in range(0, len(view), step):
        yield view[start : start + step].tobytes()


@contextlib.contextmanager
def decompressed(ckpt: Checkpoint, name: str) -> Iterator[Iterator[bytes]]:
    """A compressed zip record of ``ckpt``, decompressed in pieces of bounded size.

    Args:
        ckpt: an opened torch zip checkpoint.
        name: the record's name inside the archive's root folder (``data/0``).

    Yields:
        An iterator of pieces; zipfile checks their CRC-32 as they come
        (:class:`~ckpt_tools.errors.CorruptCheckpointError` if the record is damaged).

    Raises:
        OSError: the archive cannot be read.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> # deflated.pt: model.pt re-zipped with deflate by a zip tool
        >>> with decompressed(open_checkpoint("deflated.pt"), "data/0") as chunks:
        ...     len(b"".join(chunks))  # conv.weight: 8*3*3*3 float32
        864
    """

    # A remote archive is read through its range cache, as a file.
    with (
        open_buffered(ckpt.path, ckpt.remote.get(ckpt.path)) as source,
        _zip_archive(ckpt.path, source) as archive,
        archive.open(f"{ckpt.archive_root}/{name}") as member,
    ):
        yield _member_chunks(member, ckpt.path, name)


@contextlib.contextmanager
def _zip_archive(path: str, source: BinaryIO) -> Iterator[Any]:
    import zipfile

    try:
        archive = zipfile.ZipFile(source)
    except zipfile.BadZipFile as e:
        raise OSError(errno.EIO, f"{path!r}: {e}") from e
    with archive:
        yield archive


def _member_chunks(member: Any, path: str, name: str) -> Iterator[bytes]:
    import zipfile

    while True:
        try:
            piece = member.read(DEFAULT_CHUNK_BYTES)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            # The input's fault, not the output's (a writer reports OSErrors as its own).
            raise CorruptCheckpointError(
                f"{path!r}: record {name!r} does not decompress: {e}", path=path
            ) from e
        if not piece:
            return
        yield piece
