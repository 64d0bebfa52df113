"""The plan every transform (slim, extract, average) builds, and the one place that executes it.

A :class:`TransformPlan` holds the output's object tree and one
:class:`~ckpt_tools.io.writers.plan.Record` per output storage: copied from a source span, or
streamed by a producer (a cast, a mean).
:func:`execute_plan` writes it through the one writer (atomic temp file, fsync, verification,
rename); ``dry_run`` callers render the plan instead (:meth:`TransformPlan.to_json`).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.descriptors import GlobalRef, StorageRef, TensorRef, iter_tensors
from ckpt_tools.errors import VerificationError
from ckpt_tools.formats import Checkpoint
from ckpt_tools.formats.pickle.standins import storage_type_ref
from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.casting import cast_chunk, iter_cast
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.tensor_bytes import decompressed, iter_row_major
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers.plan import (
    Record,
    same_record_bytes,
    write_plan_safetensors,
    write_plan_zip,
)

__all__ = [
    "PlanRow",
    "TransformPlan",
    "cast_tensor",
    "copy_record",
    "execute_plan",
    "tensor_bytes_record",
]

_OPTIMIZER_ENTRIES = ("optimizer", "optimizer_states", "optimizer_state_dict", "optim", "opt")


@dataclass(frozen=True)
class PlanRow:
    """One output tensor (or a dropped one): its key before and after, dtypes, sizes, action."""

    source_key: str
    key: str | None
    dtype_before: str
    dtype_after: str | None
    nbytes_before: int
    nbytes_after: int
    action: str

    def to_json(self) -> dict[str, Any]:
        return {
            "source_key": self.source_key,
            "key": self.key,
            "dtype_before": self.dtype_before,
            "dtype_after": self.dtype_after,
            "nbytes_before": self.nbytes_before,
            "nbytes_after": self.nbytes_after,
            "action": self.action,
        }


@dataclass(frozen=True)
class TransformPlan:
    """What a transform will write, before a byte is written.

    Attributes:
        command: ``slim``, ``extract`` or ``average``.
        sources: the input files.
        dst: the output path.
        output_format: ``torch-zip`` or ``safetensors``.
        tree: the torch output's object tree (None for safetensors).
        records: ``id(output storage)`` -> its record (torch outputs).
        entries: ``(name, tensor, record)`` for safetensors outputs.
        metadata: safetensors ``__metadata__``.
        expected: the output state dict's tensors, for verification.
        select_out: the path of the state dict in the output.
        rows: one row per tensor of the state dict acted on.
        dropped_entries: top-level entries left out.
        size_before: bytes per category (weights, optimizer, other) in the input.
        size_after: bytes per category in the output (records; the pickle not counted).
        notes: what else was decided (which EMA copy, storages kept uncast ...).
    """

    command: str
    sources: tuple[str, ...]
    dst: str
    output_format: str
    tree: Any
    records: Mapping[int, Record]
    entries: tuple[tuple[str, TensorRef, Record], ...]
    metadata: Mapping[str, str] | None
    expected: Mapping[str, TensorRef]
    select_out: tuple[str, ...]
    rows: tuple[PlanRow, ...]
    dropped_entries: tuple[str, ...] = ()
    size_before: Mapping[str, int] = field(default_factory=dict)
    size_after: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def output_bytes(self) -> int:
        """Tensor bytes the output will hold."""
        if self.output_format == "safetensors":
            return sum(r.nbytes for _, _, r in self.entries)
        return sum(r.nbytes for r in self.records.values())

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what ``--dry-run --json`` prints)."""
        return {
            "command": self.command,
            "sources": list(self.sources),
            "dst": self.dst,
            "output_format": self.output_format,
            "select_out": list(self.select_out),
            "output_bytes": self.output_bytes,
            "size_before": dict(self.size_before),
            "size_after": dict(self.size_after),
            "dropped_entries": list(self.dropped_entries),
            "notes": list(self.notes),
            "tensors": [row.to_json() for row in self.rows],
        }


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
    zip_record = ckpt.records.get(f"data/{storage.key}")
    crc = None
    if (
        zip_record is not None
        and not zip_record.compressed
        and zip_record.size == span.nbytes
        and os.path.samefile(span.path, ckpt.path)
    ):
        crc = zip_record.crc32
    return Record(span.nbytes, span=span, crc32=crc)


def cast_storage_record(ckpt: Checkpoint, storage: StorageRef, src: str, dst: str) -> Record:
    """A record streaming ``storage`` (elements of ``src``) cast to ``dst``."""
    if _compressed(ckpt, storage) is not None:
        return _cast_stream(copy_record(ckpt, storage), src, dst)
    span = ckpt.span(storage)
    numel = span.nbytes // _itemsize(src)

    def produce() -> Iterable[bytes]:
        fd = os.open(span.path, os.O_RDONLY)
        try:
            yield from iter_cast(fd, span.offset, numel, src, dst)
        finally:
            os.close(fd)

    return Record(numel * _itemsize(dst), produce=produce, action=f"cast {src} -> {dst}")


def _compressed(ckpt: Checkpoint, storage: StorageRef) -> Any:
    record = ckpt.records.get(f"data/{storage.key}") if storage.view is None else None
    return record if record is not None and record.compressed else None


def _cast_stream(source: Record, src: str, dst: str) -> Record:
    """``source``'s bytes (elements of ``src``, in pieces of any length) cast to ``dst``."""
    size = _itemsize(src)
    numel = source.nbytes // size

    def produce() -> Iterable[bytes]:
        assert source.produce is not None
        pending, first = b"", 0
        for piece in source.produce():
            pending += piece
            whole = len(pending) - len(pending) % size
            if whole:
                yield cast_chunk(pending[:whole], src, dst, first, numel)
                first += whole // size
                pending = pending[whole:]

    return Record(numel * _itemsize(dst), produce=produce, action=f"cast {src} -> {dst}")


def tensor_bytes_record(ckpt: Checkpoint, t: TensorRef, dst: str | None = None) -> Record:
    """One tensor's elements in row-major order (safetensors), cast to ``dst`` if given."""
    span = ckpt.span(t.storage)
    if dst is None or dst == t.dtype:
        if t.is_contiguous():
            start = span.offset + t.byte_span[0]
            from ckpt_tools.descriptors import ByteSpan

            return Record(t.nbytes, span=ByteSpan(span.path, start, t.nbytes))
        dst = t.dtype

    def produce() -> Iterable[bytes]:
        fd = os.open(span.path, os.O_RDONLY)
        done = 0
        try:
            for piece in iter_row_major(fd, span.offset, t):
                if dst == t.dtype:
                    yield piece
                else:
                    yield cast_chunk(piece, t.dtype, dst, done, t.numel)
                done += len(piece) // _itemsize(t.dtype)
        finally:
            os.close(fd)

    action = "copy" if dst == t.dtype else f"cast {t.dtype} -> {dst}"
    return Record(t.numel * _itemsize(dst), produce=produce, action=action)


def _itemsize(dtype: str) -> int:
    from ckpt_tools.dtypes import itemsize

    return itemsize(dtype)


def new_storage(like: StorageRef, dtype: str, numel: int) -> StorageRef:
    """An output storage of ``numel`` elements of ``dtype`` on ``like``'s device."""
    return StorageRef(like.key, dtype, numel, like.device, storage_type=storage_type_ref(dtype))


def cast_tensor(t: TensorRef, storage: StorageRef, dtype: str) -> TensorRef:
    """``t``'s view (offset, shape, stride) over ``storage`` as ``dtype`` (torch.save's pickle)."""
    hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    v2 = GlobalRef("torch._utils", "_rebuild_tensor_v2")
    view = (t.offset, t.shape, t.stride)
    if not t.is_parameter:
        args = (storage, *view, t.requires_grad, hooks)
        return TensorRef(storage, *view, dtype, t.requires_grad, False, v2, args)
    inner = TensorRef(storage, *view, dtype, False, False, v2, (storage, *view, False, hooks))
    param = GlobalRef("torch._utils", "_rebuild_parameter")
    args = (inner, t.requires_grad, collections.OrderedDict())
    return TensorRef(storage, *view, dtype, t.requires_grad, True, param, args)


def categories(
    ckpt: Checkpoint, root: Any, sd_path: Sequence[str], sd: Mapping[Any, Any]
) -> dict[str, int]:
    """Storage bytes per category: ``weights`` (the state dict), ``optimizer``, ``other``."""
    sizes = {"weights": 0, "optimizer": 0, "other": 0}
    seen: set[int] = set()

    def count(tensors: Iterable[TensorRef], category: str) -> None:
        for t in tensors:
            if id(t.storage) not in seen:
                seen.add(id(t.storage))
                sizes[category] += t.storage.nbytes

    count((v for v in sd.values() if isinstance(v, TensorRef)), "weights")
    if isinstance(root, Mapping) and tuple(sd_path) != ():
        for name, value in root.items():
            category = "optimizer" if str(name) in _OPTIMIZER_ENTRIES else "other"
            count((t for _, t in iter_tensors(value)), category)
    return sizes


def execute_plan(
    plan: TransformPlan,
    target: Any,
    source: Checkpoint,
    verify: str = "sizes",
    progress: Callable[[int], None] | None = None,
    durable: bool = True,
) -> str:
    """Write ``plan`` to ``target`` atomically and verify it; returns what was verified.

    ``durable`` False skips the fsync (see :func:`~ckpt_tools.io.atomic.atomic_output`).

    Raises:
        UsageError: a verification level transforms do not offer.
        VerificationError / OutputError: the output does not read back or cannot be written.
    """
    # ``full`` compares every written record with its record computed again (a cast, a
    # mean) or read again (a copy).
    check_verify_level(verify, why="cast and averaged bytes differ from the source's by design")
    check_output_size([], plan.output_bytes, target)
    with atomic_output(target, durable=durable) as out:
        if plan.output_format == "safetensors":
            write_plan_safetensors(
                plan.entries, out.file, plan.metadata, progress, durable=out.durable
            )
            written: list[Record] = [r for _, _, r in plan.entries]
        else:
            root = source.archive_root or "archive"
            used = write_plan_zip(
                plan.tree, plan.records, out.file, root, progress, durable=out.durable
            )
            written = [plan.records[id(s)] for s in used]
        out.file.flush()
        level = "sizes" if verify == "full" else verify
        expected = Expected(plan.expected, plan.select_out, source)
        checked = verify_output(str(out.path), expected, level)
        if verify == "full":
            checked = _verify_bytes(str(out.path), plan.output_format, written)
        return checked


def _verify_bytes(path: str, fmt: str, written: Sequence[Record]) -> str:
    """Every record's bytes against the record made again (``verify="full"``)."""
    if fmt == "safetensors":
        with open(path, "rb") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
        starts = []
        for record in written:
            starts.append(start)
            start += record.nbytes
    else:
        from ckpt_tools.formats import open_checkpoint

        records = open_checkpoint(path).records
        starts = [records[f"data/{i}"].data_offset for i in range(len(written))]
    for i, (start, record) in enumerate(zip(starts, written)):
        if not same_record_bytes(path, start, record):
            raise VerificationError(f"record {i} ({record.action}) differs after writing")
    return f"verified: keys, sizes and the bytes of {len(written)} records"
