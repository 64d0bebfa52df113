"""Planning a consolidation: what goes into the output, and where each tensor's bytes come from.

Everything that can refuse happens here, before any byte is written: the selection, key
collisions after ``strip``, non-tensor entries for safetensors, and every chunk archive
(each is read and checked, its tensor located).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools._types import Select
from ckpt_tools.descriptors import ByteSpan, Opaque, StorageRef, TensorRef, contiguous_stride
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import ConversionError, KeyCollisionError, UnsafeContentError
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.pickle.standins import storage_type_ref
from ckpt_tools.formats.safetensors import tie_metadata
from ckpt_tools.io.assemble import AssembledPiece, ChunkSource, Piece, SpanPiece
from ckpt_tools.io.writers.records import Record
from ckpt_tools.io.writers.safetensors import leave_out_extras
from ckpt_tools.ops.transform.plan import check_computable
from ckpt_tools.structure.keys import rename_keys
from ckpt_tools.structure.selection import Selection, replace_at, select_state_dict
from ckpt_tools.structure.tensor_walk import iter_stored_tensors
from ckpt_tools.structure.wrappers import strip_wrapper_rules

__all__ = ["ConsolidationPlan", "OutputTensor", "plan_consolidation", "strip_notes"]


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: its flat name, its new descriptor, and its byte pieces (or,
    for bytes computed rather than cut from pieces, the record that makes them)."""

    name: str
    tensor: TensorRef
    pieces: tuple[Piece, ...]
    record: Record | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its storage's record (a value's whole storage, which views may share)."""
        return self.tensor.nbytes if self.record is None else self.record.nbytes

    @property
    def copied(self) -> int:
        """Bytes moved by kernel copies (the rest is assembled through a buffer)."""
        if self.record is not None:
            return self.record.copied
        return sum(p.nbytes for p in self.pieces if isinstance(p, SpanPiece))


@dataclass(frozen=True)
class ConsolidationPlan:
    """The output tree (for torch files) and its tensors in writing order.

    Attributes:
        tree: the object tree to pickle, its tensors replaced by :attr:`tensors`' descriptors.
        tensors: every output tensor, in the tree's order.
        selected: the path of the selected state dict (empty with ``all``).
        dropped: names left out of a safetensors output: non-tensor entries, and tied names
            (those also in ``aliases``).
        renamed: ``(old, new)`` key pairs from ``strip``.
        notes: what else was decided, in words.
        aliases: ``{tied name: stored name}`` of the tied names a safetensors output stores
            once; written into its metadata (an HF index's, when sharded), as huggingface_hub
            records them, and our readers take each back as its stored tensor.
    """

    tree: Any
    tensors: tuple[OutputTensor, ...]
    selected: tuple[str, ...]
    dropped: tuple[str, ...]
    renamed: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def tie_metadata(self) -> dict[str, str]:
        """The metadata that records ``aliases`` in a safetensors output (a file's, or a
        sharded folder's index)."""
        return tie_metadata(self.aliases)

    @property
    def nbytes(self) -> int:
        """Bytes of the output's tensors (tied names share one storage, written once)."""
        return sum({id(t.tensor.storage): t.nbytes for t in self.tensors}.values())

    @property
    def copied(self) -> int:
        """Of those, the bytes kernel copies move."""
        return sum({id(t.tensor.storage): t.copied for t in self.tensors}.values())


def _pieces(ckpt: DcpCheckpoint, t: TensorRef, name: str) -> tuple[Piece, ...]:
    """Where ``t`` (output key ``name``)'s bytes come from, in row-major order.

    Raises:
        ConversionError: a chunk of it (or it) is saved as a negative or conjugate view:
            torch.load applies the bit to the bytes, which are copied as they are.
    """
    size = itemsize(t.dtype)
    doing = "consolidate's copy of each chunk"
    if id(t) not in ckpt.tensors:
        # A tensor inside a value (BYTE_IO), written as a tensor of its own (safetensors).
        check_computable(name, t, doing, cast=False)
        span = ckpt.span(t.storage)
        return (SpanPiece(ByteSpan(span.path, span.offset + t.byte_offset, t.nbytes)),)
    item = ckpt.item_of(t)
    chunks = [
        ckpt.chunk_tensor(item, c)
        for c in sorted(item.chunks, key=lambda c: c.offsets)
        if math.prod(c.sizes)
    ]
    for d in chunks:
        check_computable(name, d.tensor, doing, cast=False)
    if all(d.chunk.sizes[1:] == item.shape[1:] and d.tensor.is_contiguous() for d in chunks):
        # Dim-0 slices (FSDP), sorted and known to tile the tensor: back to back they are it.
        return tuple(
            # No CRC-32 passed on: torch's zip reader never checks the one a chunk's archive
            # records, so a damaged chunk's would make a wrong one; it is computed on copy.
            SpanPiece(ByteSpan(d.span.path, d.span.offset + d.tensor.byte_offset, d.tensor.nbytes))
            for d in chunks
        )
    sources = tuple(ChunkSource(d.chunk.offsets, d.tensor, d.span) for d in chunks)
    return (AssembledPiece(item.shape, size, sources),)


def _fresh(t: TensorRef, key: str) -> TensorRef:
    """A contiguous tensor of ``t``'s dtype and shape on a new storage ``key``, on cpu."""
    storage = StorageRef(
        key=key,
        dtype=t.dtype,
        numel=t.numel,
        device="cpu",
        storage_type=storage_type_ref(t.dtype),
    )
    # requires_grad=False whatever DCP recorded: dcp_to_torch_save rebuilds every tensor
    # with torch.empty(size, dtype) (its _EmptyStateDictLoadPlanner), and so do we.
    return TensorRef(storage, 0, t.shape, contiguous_stride(t.shape), t.dtype, False)


class _Collector:
    """Replaces each DCP tensor of a tree by its output descriptor, collecting the plan.

    DCP nests its items in plain dicts and lists (``planner_data``); anything else is a
    saved value (BYTE_IO), kept as ``torch.load`` gives it: each storage its tensors lie in
    (inside tuples, sets, rebuilt tensors too) is copied whole, so views and shared storages
    come back as they were saved, as ``dcp_to_torch_save`` writes them.
    """

    def __init__(self, ckpt: DcpCheckpoint) -> None:
        self.ckpt = ckpt
        self.tensors: list[OutputTensor] = []
        self.kept: set[int] = set()

    def tensor(self, name: str, t: TensorRef) -> TensorRef:
        if id(t) not in self.ckpt.tensors and not t.is_contiguous():
            raise ConversionError(
                f"{self.ckpt.path!r}: the saved value {name!r} is a strided view (shape "
                f"{list(t.shape)}, stride {list(t.stride)}) of a storage, which a safetensors "
                "output cannot hold as saved; write a .pt (a dst ending in .pt) to keep it"
            )
        out = _fresh(t, str(len(self.tensors)))
        self.tensors.append(OutputTensor(name, out, _pieces(self.ckpt, t, name)))
        return out

    def value(self, node: Any, name: str) -> Any:
        for path, t in iter_stored_tensors(node, name):
            if id(t.storage) not in self.kept:
                self.kept.add(id(t.storage))
                span = self.ckpt.span(t.storage)  # CRC-32 computed on copy, as for chunks
                self.tensors.append(OutputTensor(path, t, (), Record(span.nbytes, span=span)))
        return node

    def tree(self, node: Any, name: str) -> Any:
        if isinstance(node, TensorRef) and id(node) in self.ckpt.tensors:
            return self.tensor(name, node)
        if type(node) is dict:
            return {k: self.tree(v, f"{name}.{k}" if name else str(k)) for k, v in node.items()}
        if type(node) in (list, tuple):
            items = [self.tree(v, f"{name}.{i}" if name else str(i)) for i, v in enumerate(node)]
            return items if type(node) is list else tuple(items)
        if isinstance(node, Opaque):
            # A rewrite never adds a global the user did not allow: refuse, naming it.
            qualname = type(node).global_ref.qualname
            raise UnsafeContentError(
                f"{self.ckpt.path!r}: the saved value {name!r} is a {qualname}, a global "
                "outside the allowlist; leave it out (select the state dict only)",
                globals=(qualname,),
                path=self.ckpt.path,
            )
        return self.value(node, name)


def _strip(sd: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    rules, _ = strip_wrapper_rules(sd)
    if not rules:
        return dict(sd), ()
    out = rename_keys(sd, rules)
    return out, tuple((a, b) for a, b in zip(sd, out) if a != b)


def strip_notes(strip: bool, renamed: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """What a strip that changed nothing says: the keys were written as saved (strip-module
    says as much, rather than leaving the keys as they were without a word)."""
    if strip and not renamed:
        return ("strip: no wrapper prefix that every key carries; the keys are as saved",)
    return ()


def plan_consolidation(
    ckpt: DcpCheckpoint,
    *,
    select: Select,
    everything: bool,
    strip: bool,
    tensors_only: bool,
    drop_extras: bool = False,
) -> ConsolidationPlan:
    """Plan the output of :func:`~ckpt_tools.ops.consolidate.consolidation.consolidate`.

    Args:
        ckpt: the opened DCP folder.
        select: the state dict to write (a dotted path); None picks it as ``inspect`` does.
        everything: write the whole saved tree (model, optimizer, other entries).
        strip: remove wrapper prefixes from the selected state dict's keys.
        tensors_only: the output holds tensors only (safetensors): names are the flattened
            keys, and any other value is refused, or with ``drop_extras`` left out (listed in
            ``dropped``).
        drop_extras: leave out the values that are not tensors instead of refusing them.

    Raises:
        SelectError: ``select`` names no entry.
        KeyCollisionError: stripping makes two keys one.
        UnsafeContentError: a value to write names globals outside the allowlist.
        NonTensorEntriesError: ``tensors_only``, values that are not tensors and not
            ``drop_extras`` (exit 7).
    """
    selection = select_state_dict(ckpt.root, select=select)
    sd, renamed = _strip(selection.state_dict) if strip else (dict(selection.state_dict), ())
    if everything:
        tree: Any = replace_at(ckpt.root, selection.path, sd) if renamed else ckpt.root
    else:
        tree = sd
    collector = _Collector(ckpt)
    dropped: list[str] = []
    if tensors_only:
        flat: dict[str, Any] = {}
        _flatten(tree, "", flat)
        out_tree: Any = {}
        for name, value in flat.items():
            if isinstance(value, TensorRef):
                out_tree[name] = collector.tensor(name, value)
            else:
                dropped.append(name)
        leave_out_extras(dropped, ckpt.path, drop_extras=drop_extras)
    else:
        out_tree = collector.tree(tree, "")
    return ConsolidationPlan(
        tree=out_tree,
        tensors=tuple(collector.tensors),
        selected=() if everything else tuple(selection.path),
        notes=(() if everything else _left_out(selection)) + strip_notes(strip, renamed),
        dropped=tuple(dropped),
        renamed=renamed,
    )


def _flatten(node: Any, name: str, out: dict[str, Any]) -> None:
    """Dotted names for a nested tree (safetensors keys), leaves kept as they are."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flatten(v, f"{name}.{k}" if name else str(k), out)
    elif isinstance(node, (list, tuple)) and node:
        for i, v in enumerate(node):
            _flatten(v, f"{name}.{i}" if name else str(i), out)
    elif name in out:
        raise KeyCollisionError(f"two saved entries flatten to the same name {name!r}")
    else:
        out[name] = node


def _left_out(selection: Selection) -> tuple[str, ...]:
    """Notes naming each tensor dict passed over beside the chosen one, and how to write
    them all: their common parent holds them as dcp_to_torch_save writes it."""
    parent = ".".join(str(p) for p in selection.path[:-1])
    whole = f"select {parent!r} for all of them" if parent else "include everything saved"
    over = selection.passed_over
    return tuple(f"left out: {p} (select it to write it, or {whole})" for p in over)
