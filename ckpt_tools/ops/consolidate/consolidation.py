"""``consolidate``: a DCP folder into one ``.pt``, one ``.safetensors``, or HF shards.

Bytes move chunk by chunk (:mod:`ckpt_tools.io.assemble`): dim-0 slices with
``copy_file_range`` straight into place, other layouts through a bounded numpy slab. Peak
memory does not grow with the checkpoint, and torch is never imported. Every file is
written atomically and read back before it is named (:mod:`ckpt_tools.io.atomic`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckpt_tools._types import (
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    count_of,
)
from ckpt_tools.errors import UsageError
from ckpt_tools.formats import refuse_url
from ckpt_tools.io.output_path import check_output_folder, check_output_path
from ckpt_tools.io.verify.levels import NOT_VERIFIED, VERIFY_LEVELS, check_verify_level
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.shard_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    ShardPlan,
    index_bytes,
    parse_shard_size,
    plan_shards,
)
from ckpt_tools.ops.consolidate.deepspeed import open_source, plan_source
from ckpt_tools.ops.consolidate.plan import ConsolidationPlan
from ckpt_tools.ops.consolidate.write import write_file_output, write_folder_output
from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor, WriteResult, dry_run_fields
from ckpt_tools.ops.rewrite.plan import format_named_by

__all__ = ["CONSOLIDATE_VERIFY_LEVELS", "ConsolidateResult", "consolidate"]

#: What consolidate's verification offers, as every writing operation: ``sizes`` reads every
#: output back (keys, dtypes, shapes, layout), ``full`` also makes every record's bytes
#: again from the chunks and compares them.
CONSOLIDATE_VERIFY_LEVELS = VERIFY_LEVELS

_VERIFIED = {
    "sizes": "verified: keys and sizes",
    "full": "verified: keys, sizes and bytes",
    "none": NOT_VERIFIED,
}


@dataclass(frozen=True, kw_only=True, repr=False)
class ConsolidateResult(WriteResult):
    """What :func:`consolidate` wrote: the fields of
    :class:`~ckpt_tools.ops.output_plan.WriteResult` (``bytes_copied``: the chunks copied in
    the kernel, the rest assembled through a buffer; ``dropped``: non-tensor entries left out
    of a safetensors output; ``selected``: the state dict written, empty with
    ``include_all``; ``renamed``: how many keys ``strip`` changed).
    """

    def details(self) -> list[str]:
        """The state dict written and the keys stripped.

        Example:
            >>> r = ConsolidateResult(src="ckpt", dst="m.pt", input_format="dcp",
            ...     output_format="torch-zip", written=("m.pt",), bytes_written=64,
            ...     bytes_copied=64, message="consolidated ckpt: wrote m.pt (2 tensors)",
            ...     verification="verified: keys and sizes", tensors=2, selected=("model",))
            >>> print(r)
            consolidated ckpt: wrote m.pt (2 tensors)
            state dict: model
            torch-zip, 64 B of tensors written, 64 B of them copied; verified: keys and sizes
        """
        lines = [f"state dict: {'.'.join(self.selected)}"] if self.selected else []
        if self.renamed:
            lines.append(f"stripped wrapper prefixes from {self.renamed} keys")
        return lines


def _output_format(dst: str, max_shard_size: str | int | None) -> str:
    if max_shard_size is not None:  # as convert and merge_lora: a shard size asks for shards
        return "hf-sharded"
    named = format_named_by(dst)
    if named is not None:
        return named
    if os.path.isfile(dst):
        raise UsageError(
            f"output {dst!r} is a file without a .pt or .safetensors suffix; name a .pt, "
            "a .safetensors, or a folder for Hugging Face shards",
            argument="dst",
            value=dst,
        )
    return "hf-sharded"


@checked_flags
def consolidate(
    src: StrPath,
    dst: StrPath,
    *,
    include_all: bool = False,
    strip: bool = False,
    tag: str | None = None,
    exclude_frozen: bool = False,
    max_shard_size: str | int | None = None,
    select: Select = None,
    drop_extras: bool = False,
    force: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
    jobs: int = 1,
) -> ConsolidateResult:
    """Write a torch.distributed.checkpoint folder or a DeepSpeed ZeRO checkpoint as one file
    or as HF shards, torch-free.

    Args:
        src: the DCP folder (``.metadata`` and ``*.distcp`` files), or a DeepSpeed ZeRO
            checkpoint (stages 0 to 3): its save folder (``latest`` names the tag) or a
            tag folder (or, with ``tag``, a save folder without ``latest``). It is written as
            the state dict DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` gives
            (fp32 master weights, frozen ones in their trained dtype, float buffers in fp32;
            the ``zero_to_fp32.py`` script also casts the frozen ones to fp32), its bytes cut
            from the ranks' partitions; ZeRO-0's module weights as saved, in their dtype.
        dst: a ``.pt`` (torch.save format), a ``.safetensors``, or a folder for Hugging
            Face shards (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``).
        include_all: write everything saved (model, optimizer, other entries), nested as
            saved, instead of the selected state dict alone.
        strip: remove wrapper prefixes (``module.``, ``_orig_mod.``) from the state dict's keys.
        tag: the DeepSpeed tag to read (default: the one ``latest`` names; a save folder
            without ``latest`` needs it).
        exclude_frozen: leave a DeepSpeed checkpoint's frozen parameters out.
        max_shard_size: the most bytes per HF shard (``"5GB"``, ``"2GiB"``, or an int);
            given, the output is a folder of shards, as with :func:`convert`; None: ``"5GB"``
            where ``dst`` is a folder.
        select: the state dict to write, or with ``include_all`` the one ``strip`` acts on
            (a dotted path, e.g. ``"model"``); None picks it as ``inspect`` does.
        drop_extras: a safetensors output (a file or shards) leaves out the values that are
            not tensors (an optimizer's ``param_groups``, a step count), listed in the
            result's ``dropped``, instead of refusing them.
        force: replace an existing output (never the input): a file, or for HF shards the
            weight files of a non-empty folder (``model*.safetensors``,
            ``pytorch_model*.bin`` and their index), keeping everything else in it, as
            ``convert`` and ``reshard`` do.
        verify: ``sizes`` (default: read every output back, keys, dtypes, shapes, layout),
            ``full`` (also every byte, each record made again from the chunks) or ``none``.
        dry_run: plan and check everything (refusals included), write nothing: the result's
            ``planned`` lists each file, its tensors, dtypes, shapes and sizes.
        durable: fsync every output before naming it (default); False skips it, as ``cp``
            does (see :func:`~ckpt_tools.io.atomic.atomic_output`).
        progress: called with ``(done_bytes, total_bytes)`` as tensor bytes are written
            (:data:`~ckpt_tools._types.Progress`).
        jobs: how many HF shards to write at once.

    Returns:
        The :class:`ConsolidateResult`.

    Raises:
        UsageError: ``src`` is not a DCP folder or a DeepSpeed checkpoint, or bad arguments
            (a ``tag`` that names no tag folder among them).
        CorruptCheckpointError: the folder's metadata or chunks are malformed (nothing written).
        OutputError: an output exists (without ``force``) or could not be written.
        NonTensorEntriesError: a safetensors output, values that are not tensors (with
            ``include_all``, an optimizer's ``param_groups``) and not ``drop_extras``.

    Example:
        >>> import warnings, torch, torch.distributed.checkpoint as dcp
        >>> with warnings.catch_warnings():  # (saving without a process group warns)
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"model": {"fc.weight": torch.ones(2, 3)}}, checkpoint_id="run")
        >>> print(consolidate("run", "m.safetensors"))
        consolidated run: wrote m.safetensors (1 tensors)
        state dict: model
        safetensors, 24 B of tensors written, 24 B of them copied; verified: keys and sizes
    """
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    refuse_url(src)  # before any message names it (a URL's credentials are never shown)
    count_of(jobs, "jobs", flag="--jobs")
    check_verify_level(verify, CONSOLIDATE_VERIFY_LEVELS)
    ckpt = open_source(src, tag=tag, exclude_frozen=exclude_frozen)
    fmt = _output_format(dst, max_shard_size)
    limit = parse_shard_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    if fmt == "hf-sharded":
        target = check_output_folder(dst, src, force=force)
    else:
        target = check_output_path(dst, src, force=force, in_place=None)
    plan = plan_source(
        ckpt,
        select=select,
        everything=include_all,
        strip=strip,
        exclude_frozen=exclude_frozen,
        tensors_only=fmt != "torch-zip",
        drop_extras=drop_extras,
    )
    shared = {
        "src": src,
        "dst": dst,
        "input_format": ckpt.format,
        "output_format": fmt,
        "bytes_written": plan.nbytes,
        "bytes_copied": plan.copied,
        "notes": plan.notes,
        "dropped": plan.dropped,
        "tensors": len(plan.tensors),
        "selected": plan.selected,
        "renamed": len(plan.renamed),
    }
    if dry_run:
        planned = _planned(dst, fmt, plan, limit)
        message = f"dry run: would consolidate {src} into {dst} ({len(plan.tensors)} tensors)"
        return ConsolidateResult(**shared, **dry_run_fields(dst, planned), message=message)
    counter = ByteCounter(progress, shared["bytes_written"])
    if fmt == "hf-sharded":
        shards = _shards(plan, limit)
        names = write_folder_output(target, plan, shards, verify, counter, jobs, durable, force)
        written = tuple(os.path.join(dst, name) for name in names)
        verification = _VERIFIED[verify]
    else:
        verification = write_file_output(target, fmt, plan, verify, counter, durable, force)
        written = (dst,)
    return ConsolidateResult(
        **shared,
        written=written,
        message=f"consolidated {src}: wrote {dst} ({len(plan.tensors)} tensors)",
        verification=verification,
    )


def _shards(plan: ConsolidationPlan, limit: int) -> ShardPlan:
    return plan_shards([(t.name, t.tensor.nbytes) for t in plan.tensors], limit)


def _planned(dst: str, fmt: str, plan: ConsolidationPlan, limit: int) -> tuple[PlannedFile, ...]:
    """The files the plan would write (a torch file's storages counted once: tied names
    share one)."""
    if fmt == "torch-zip":
        return (PlannedFile.of_tree(dst, plan.tree),)
    tensors = {t.name: PlannedTensor.of(t.name, t.tensor) for t in plan.tensors}
    if fmt != "hf-sharded":
        return (PlannedFile.of(dst, tensors.values()),)
    shards = _shards(plan, limit)
    planned = [
        PlannedFile.of(os.path.join(dst, file), (tensors[n] for n in names))
        for file, names in shards.files
    ]
    if shards.is_sharded:
        index = len(index_bytes(shards, plan.tie_metadata))
        planned.append(PlannedFile(os.path.join(dst, INDEX_NAME), (), index))
    return tuple(planned)
