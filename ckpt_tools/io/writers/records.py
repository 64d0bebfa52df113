"""Where each record of an output comes from: a span copied from a source, or a producer.

A :class:`Record` is one output record's bytes (a storage of a torch file, a tensor of a
safetensors file): a span of a source file copied as it is, the pieces of a tensor
assembled from DCP chunks, or a producer that yields them in bounded chunks (a cast, a mean
of N inputs, an inflated zip record, a view gathered in row-major order). The writers of
:mod:`ckpt_tools.io.writers` write records; ``verify="full"`` makes each one again and
compares it with what was written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_tools.descriptors import ByteSpan, StorageRef, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.io.ranges import SourceEndedError, fd_pread, pread_chunks
from ckpt_tools.io.tensor_bytes import decompressed, iter_row_major

if TYPE_CHECKING:
    from ckpt_tools.io.assemble import Piece

# io.assemble and io.casting compute with numpy: imported where a record needs them, so a
# rewrite that only copies never loads numpy.

__all__ = [
    "Record",
    "cast_span_record",
    "cast_storage_record",
    "cast_stream",
    "check_records",
    "copy_record",
    "record_bytes",
    "remote_span_record",
    "same_record_bytes",
    "tensor_bytes_record",
]


@dataclass(frozen=True)
class Record:
    """Where one output record's bytes come from: a source span, chunk pieces, or a producer.

    Exactly one of ``span``, ``pieces`` and ``produce`` is given.

    Attributes:
        nbytes: the record's size.
        span: bytes to copy as they are (the copy engine), or None.
        crc32: the span's CRC-32 when known (a whole zip record), so it is not recomputed.
        pieces: the record's bytes as DCP chunk pieces, back to back
            (:func:`~ckpt_tools.io.assemble.write_pieces`: spans copied, the rest assembled).
        produce: called once when the record is written; yields its bytes in bounded chunks.
        action: what makes it, in words (``copy``, ``cast float32 -> bfloat16``, ``mean of 3``).
    """

    nbytes: int
    span: ByteSpan | None = None
    crc32: int | None = None
    pieces: tuple[Piece, ...] = ()
    produce: Callable[[], Iterable[bytes]] | None = None
    action: str = "copy"

    @property
    def copied(self) -> int:
        """Bytes of it copied from a source as they lie there (spans), not computed."""
        if self.span is not None:
            return self.nbytes
        return sum(p.nbytes for p in self.pieces if isinstance(getattr(p, "span", None), ByteSpan))


def copy_record(ckpt: Checkpoint, storage: StorageRef) -> Record:
    """A record copying ``storage``'s bytes as they are (with the CRC-32 of a whole zip record).

    A compressed zip record (a re-zipped archive; torch reads those) is inflated in bounded
    pieces and written stored, as the rewrites do.
    """
    zip_record = _compressed(ckpt, storage)
    if zip_record is not None:
        name = f"data/{storage.key}"

        def inflate() -> Iterable[bytes]:
            with decompressed(ckpt, name) as chunks:
                yield from chunks

        return Record(zip_record.size, produce=inflate, action="copy (inflated)")
    span = ckpt.span(storage)
    remote = remote_span_record(ckpt, span)
    if remote is not None:
        return remote
    zip_record = ckpt.records.get(f"data/{storage.key}")
    crc = None
    if (
        zip_record is not None
        and zip_record.crc32 != 0  # torch wrote none (compute_crc32=False): computed on copy
        and not zip_record.compressed
        and zip_record.size == span.nbytes
        and os.path.samefile(span.path, ckpt.path)
    ):
        crc = zip_record.crc32
    return Record(span.nbytes, span=span, crc32=crc)


def cast_storage_record(ckpt: Checkpoint, storage: StorageRef, src: str, dst: str) -> Record:
    """A record streaming ``storage`` (elements of ``src``) cast to ``dst``."""
    if _compressed(ckpt, storage) is not None or ckpt.remote:
        return cast_stream(copy_record(ckpt, storage), src, dst)
    span = ckpt.span(storage)
    return cast_span_record(span, span.nbytes // itemsize(src), src, dst)


def cast_span_record(span: Any, numel: int, src: str, dst: str) -> Record:
    """A record streaming ``numel`` elements of ``src`` from ``span`` (a file's bytes at an
    offset), cast to ``dst``."""

    def produce() -> Iterable[bytes]:
        from ckpt_tools.io.casting import iter_cast

        fd = os.open(span.path, os.O_RDONLY)
        try:
            yield from iter_cast(fd, span.offset, numel, src, dst)
        finally:
            os.close(fd)

    return Record(numel * itemsize(dst), produce=produce, action=f"cast {src} -> {dst}")


def _compressed(ckpt: Checkpoint, storage: StorageRef) -> Any:
    record = ckpt.records.get(f"data/{storage.key}") if storage.view is None else None
    return record if record is not None and record.compressed else None


def cast_stream(source: Record, src: str, dst: str, *, runs: Sequence[int] | None = None) -> Record:
    """``source``'s bytes (elements of ``src``: a span, pieces or a producer's chunks of any
    length) cast to ``dst``; with ``runs`` (sorted bounds from 0 to the element count), each
    stretch between two bounds is cast as a tensor of its own, as torch casts each view."""
    size = itemsize(src)
    numel = source.nbytes // size

    def produce() -> Iterable[bytes]:
        from ckpt_tools.io.casting import cast_chunk

        pending, first = b"", 0
        for piece in record_bytes(source):
            pending += piece
            whole = len(pending) - len(pending) % size
            if whole:
                yield cast_chunk(pending[:whole], src, dst, first, numel, runs=runs)
                first += whole // size
                pending = pending[whole:]

    return Record(numel * itemsize(dst), produce=produce, action=f"cast {src} -> {dst}")


def tensor_bytes_record(ckpt: Checkpoint, t: TensorRef, dst: str | None = None) -> Record:
    """One tensor's elements in row-major order (safetensors), cast to ``dst`` if given.

    A compressed storage record is inflated when the bytes are written, not when the
    record is planned: a dry run makes no inflated copy (:meth:`Checkpoint.check_span`)."""
    if _compressed(ckpt, t.storage) is None:
        return _tensor_bytes(ckpt, t, dst)
    ckpt.check_span(t.storage)

    def produce() -> Iterable[bytes]:
        yield from record_bytes(_tensor_bytes(ckpt, t, dst))

    action = "copy (inflated)" if dst in (None, t.dtype) else f"cast {t.dtype} -> {dst}"
    return Record(t.numel * itemsize(dst or t.dtype), produce=produce, action=action)


def _tensor_bytes(ckpt: Checkpoint, t: TensorRef, dst: str | None) -> Record:
    span = ckpt.span(t.storage)
    if t.is_contiguous():
        piece = ByteSpan(span.path, span.offset + t.byte_span[0], t.nbytes)
        record = remote_span_record(ckpt, piece) or Record(t.nbytes, span=piece)
        if dst is None or dst == t.dtype:
            return record
        if ckpt.remote:
            return cast_stream(record, t.dtype, dst)
    elif ckpt.remote:
        raise UnsupportedFormatError(
            f"{ckpt.path!r}: tensor over storage {t.storage.key!r} is a strided view (not "
            "contiguous), which is gathered from a local file only; download the file and "
            "pass its path",
            path=ckpt.path,
        )
    dst = t.dtype if dst is None else dst

    def produce() -> Iterable[bytes]:
        from ckpt_tools.io.casting import cast_chunk

        fd = os.open(span.path, os.O_RDONLY)
        done = 0
        try:
            for piece in iter_row_major(fd, span.offset, t):
                if dst == t.dtype:
                    yield piece
                else:
                    yield cast_chunk(piece, t.dtype, dst, done, t.numel)
                done += len(piece) // itemsize(t.dtype)
        finally:
            os.close(fd)

    action = "copy" if dst == t.dtype else f"cast {t.dtype} -> {dst}"
    return Record(t.numel * itemsize(dst), produce=produce, action=action)


def remote_span_record(ckpt: Checkpoint, span: ByteSpan) -> Record | None:
    """A record fetching ``span`` from the remote file it lies in, in bounded requests; None
    where ``span`` lies in a local file."""
    source = ckpt.remote.get(span.path)
    if source is None:
        return None

    def produce() -> Iterable[bytes]:
        try:
            yield from pread_chunks(source.pread, span.offset, span.nbytes)
        except SourceEndedError as e:
            raise CorruptCheckpointError(
                f"{span.path!r} ended after {e.done} of the {span.nbytes} bytes at offset "
                f"{span.offset} (the remote file changed or is truncated)",
                path=span.path,
            ) from e

    return Record(span.nbytes, produce=produce, action="fetch")


def record_bytes(record: Record) -> Iterable[bytes]:
    """The bytes ``record`` stands for, in bounded chunks (a producer runs again)."""
    if record.produce is not None:
        yield from record.produce()
        return
    spans = [record.span] if record.span is not None else []
    for piece in record.pieces or ():
        span = getattr(piece, "span", None)
        if span is not None:
            spans.append(span)
            continue
        yield from _spans_bytes(spans)
        spans = []
        yield from (bytes(slab) for slab in piece.iter_bytes())  # type: ignore[union-attr]
    yield from _spans_bytes(spans)


def _spans_bytes(spans: Sequence[ByteSpan]) -> Iterable[bytes]:
    for span in spans:
        fd = os.open(span.path, os.O_RDONLY)
        try:
            yield from pread_chunks(fd_pread(fd), span.offset, span.nbytes)
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


def check_records(path: str, written: Sequence[tuple[str, Record]]) -> str:
    """Every written record's bytes against the record made again (``verify="full"``).

    Args:
        path: the written file (usually still the temp file).
        written: ``(name, record)`` of every record written: a zip record's name
            (``data/0``) in a torch file, a tensor's name in a safetensors file.

    Returns:
        What was verified, in words.

    Raises:
        VerificationError: a record's bytes differ from the record made again.
    """
    from ckpt_tools.errors import VerificationError
    from ckpt_tools.formats import open_checkpoint

    out = open_checkpoint(path)
    for name, record in written:
        if out.format == "safetensors":
            start = out.span(out.root[name].storage).offset
        else:
            start = out.records[name].data_offset
        if not same_record_bytes(path, start, record):
            raise VerificationError(f"record {name!r} ({record.action}) differs after writing")
    return f"verified: keys, sizes and the bytes of {len(written)} records"
