"""Planning the consolidation of a DeepSpeed ZeRO checkpoint: the state dict ``zero_to_fp32``
rebuilds, each tensor a record of byte spans cut from the ranks' flat partitions.

The spans are copied by the copy engine (``copy_file_range`` where the kernel has it), so no
partition and no parameter is ever held in memory; only a 16-bit float buffer, which
``zero_to_fp32`` upcasts to fp32, goes through a bounded numpy cast. Shared (tied) names are
both kept in a ``.pt``, over one storage as ``zero_to_fp32`` gives them; a safetensors or
Hugging Face output stores such a tensor once, under the name huggingface_hub keeps, and
records the other name in its metadata (``{tied name: stored name}``), as ``convert`` and
``merge-lora`` do, so loading it gives both names back.
"""

from __future__ import annotations

import os
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.dcp.layout import DATA_SUFFIX
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.deepspeed.reader import DeepSpeedCheckpoint, TensorSource, open_deepspeed
from ckpt_tools.formats.detect import detect_format
from ckpt_tools.io.assemble import SpanPiece
from ckpt_tools.io.writers.records import Record, cast_span_record
from ckpt_tools.ops.consolidate.plan import (
    ConsolidationPlan,
    OutputTensor,
    _fresh,
    _strip,
    plan_consolidation,
    strip_notes,
)
from ckpt_tools.ops.transform.tied_names import hf_shared_names

__all__ = ["open_source", "plan_deepspeed", "plan_source"]


def open_source(src: str, *, tag: str | None, exclude_frozen: bool) -> Checkpoint:
    """Open what ``consolidate`` reads: a DCP folder or a DeepSpeed checkpoint.

    Args:
        src: the folder.
        tag: the DeepSpeed tag to read (None: the one ``latest`` names).
        exclude_frozen: DeepSpeed's frozen parameters are to be left out.

    Returns:
        The opened :class:`DcpCheckpoint` or :class:`DeepSpeedCheckpoint`.

    Raises:
        UsageError: another format (one ``.distcp`` shard of a DCP folder too), DeepSpeed's
            options for a DCP folder, or a ``tag`` that names no tag folder.
    """
    if src.endswith(DATA_SUFFIX) and os.path.isfile(src):
        # Each item in it is an archive at an offset only the folder's .metadata records.
        folder = os.path.dirname(src) or "."
        raise UsageError(
            f"{src!r} is one shard of a torch.distributed.checkpoint folder, which is read "
            "whole (its .metadata says where each item lies in the shards)",
            path=src,
            remedies=(Remedy(text=f"give the folder, {folder!r}, as the source instead"),),
        )
    if detect_format(src) == "deepspeed":
        return open_deepspeed(src, tag=tag)
    for name, value, flag in (
        ("tag", tag, "--tag"),
        ("exclude_frozen", exclude_frozen, "--exclude-frozen"),
    ):
        if value:
            raise UsageError(
                f"for DeepSpeed checkpoints only; {src!r} is not one",
                argument=name,
                value=repr(value),
                flag=flag,
            )
    ckpt = open_checkpoint(src)
    if not isinstance(ckpt, DcpCheckpoint):
        raise UsageError(
            f"{src!r} is a {ckpt.format} checkpoint, not a torch.distributed.checkpoint folder "
            "(a .metadata file and *.distcp files) or a DeepSpeed checkpoint (a save folder "
            "with latest, or a tag folder)",
            path=src,
        )
    return ckpt


def _record(source: TensorSource, t: TensorRef) -> tuple[tuple[SpanPiece, ...], Record | None]:
    """The tensor's pieces (its spans as they lie), or a record casting them."""
    if source.dtype == t.dtype:
        return tuple(SpanPiece(s) for s in source.spans), None
    (span,) = source.spans  # only a buffer is cast, and a buffer is one span
    return (), cast_span_record(span, t.numel, source.dtype, t.dtype)


def _names(ckpt: DeepSpeedCheckpoint, exclude_frozen: bool) -> dict[str, TensorRef]:
    """The state dict to write: ``zero_to_fp32``'s, less the frozen parameters if asked
    (and the aliases of those)."""
    gone = {n for n, s in ckpt.sources.items() if exclude_frozen and s.kind == "frozen"}
    return {
        name: t
        for name, t in ckpt.root.items()
        if name not in gone and ckpt.aliases.get(name) not in gone
    }


def plan_deepspeed(
    ckpt: DeepSpeedCheckpoint,
    *,
    select: Any,
    everything: bool,
    strip: bool,
    exclude_frozen: bool,
    tensors_only: bool,
) -> ConsolidationPlan:
    """Plan the output of a DeepSpeed checkpoint's consolidation.

    Args:
        ckpt: the opened checkpoint.
        select, everything: refused (a DeepSpeed checkpoint holds one state dict).
        strip: remove wrapper prefixes from the keys.
        exclude_frozen: leave the frozen parameters out.
        tensors_only: a safetensors output: each tied tensor stored once, its other names
            in the plan's ``aliases``.

    Returns:
        The :class:`ConsolidationPlan`: ``zero_to_fp32``'s state dict, each tensor's record.

    Raises:
        UsageError: ``select`` or ``everything`` given.
        KeyCollisionError: stripping makes two keys one.
    """
    for name, value, flag in (("select", select, "--select"), ("include_all", everything, "--all")):
        if value:
            raise UsageError(
                # (the argument is named before the message, as a flag on the command line)
                "does not apply to a DeepSpeed checkpoint, which holds one state dict "
                "(the model's)",
                argument=name,
                value=repr(value),
                flag=flag,
            )
    sd = _names(ckpt, exclude_frozen)
    named_from = {id(t): ckpt.aliases.get(n, n) for n, t in sd.items() if n not in ckpt.aliases}
    sd, renamed = _strip(sd) if strip else (sd, ())
    # A tied name is left to the metadata only where it is its stored name's very tensor: a
    # reader gives it back as that tensor, so any other view is written as its own.
    shared = hf_shared_names(sd) if tensors_only else {}
    dropped = {name: kept for name, kept in shared.items() if sd[name] is sd[kept]}
    out: dict[int, TensorRef] = {}
    tensors: list[OutputTensor] = []
    for name, t in sd.items():
        if name in dropped:
            continue
        if id(t) not in out:
            out[id(t)] = _fresh(t, str(len(out)))
            pieces, record = _record(ckpt.sources[named_from[id(t)]], out[id(t)])
            tensors.append(OutputTensor(name, out[id(t)], pieces, record))
        else:
            first = next(o for o in tensors if o.tensor is out[id(t)])
            tensors.append(OutputTensor(name, out[id(t)], first.pieces, first.record))
    notes = [f"{a} is stored once, as {b} (tied)" for a, b in dropped.items()]
    notes += strip_notes(strip, renamed)
    if ckpt.zero is not None and ckpt.zero.frozen_from_module and not exclude_frozen:
        notes.append("frozen parameters read from the module weights (ZeRO-1 records none)")
    if ckpt.zero is not None and ckpt.zero.stage == 0:
        notes.append(
            "ZeRO-0: the module weights as saved, in their dtype (a 16-bit run's fp32 master "
            "copy, in the optimizer's state, is not read)"
        )
    return ConsolidationPlan(
        tree={t.name: t.tensor for t in tensors},
        tensors=tuple(tensors),
        selected=(),
        dropped=tuple(dropped),
        renamed=renamed,
        notes=tuple(notes),
        aliases=dropped,
    )


def plan_source(
    ckpt: Checkpoint,
    *,
    select: Any,
    everything: bool,
    strip: bool,
    exclude_frozen: bool,
    tensors_only: bool,
    drop_extras: bool = False,
) -> ConsolidationPlan:
    """The plan of :func:`plan_deepspeed` for a DeepSpeed checkpoint, else of
    :func:`~ckpt_tools.ops.consolidate.plan.plan_consolidation` (a DCP folder).

    Args:
        ckpt: what :func:`open_source` opened.
        select, everything, strip, exclude_frozen, tensors_only, drop_extras: as those take
            them (a DeepSpeed checkpoint holds tensors only).

    Returns:
        The :class:`ConsolidationPlan`.
    """
    if isinstance(ckpt, DeepSpeedCheckpoint):
        return plan_deepspeed(
            ckpt,
            select=select,
            everything=everything,
            strip=strip,
            exclude_frozen=exclude_frozen,
            tensors_only=tensors_only,
        )
    assert isinstance(ckpt, DcpCheckpoint)
    return plan_consolidation(
        ckpt,
        select=select,
        everything=everything,
        strip=strip,
        tensors_only=tensors_only,
        drop_extras=drop_extras,
    )
