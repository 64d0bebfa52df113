"""Hugging Face sharded folders as outputs: ``convert`` to a folder, and ``reshard``.

Any checkpoint ``convert`` reads (a ``.pt``, a ``.safetensors``, an HF folder) becomes a
folder of ``model-0000k-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``,
bytes copied record by record (:mod:`ckpt_tools.io.writers.hf_folder`). Tied tensors are stored
once, by ``huggingface_hub.save_torch_state_dict``'s rule
(:func:`~ckpt_tools.ops.transform.tied_names.hf_shared_names`), where the names are one view
(the index records a name, not a view: a partial view is written as its own tensor). torch
is never imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_tools._escape import shell_path
from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    count_of,
    str_items,
)
from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import ConversionError, Remedy, UsageError
from ckpt_tools.formats import Checkpoint, open_checkpoint, refuse_url
from ckpt_tools.formats.detect import detect_format, is_index_name
from ckpt_tools.formats.safetensors import TIES_KEY, tie_metadata
from ckpt_tools.io.output_path import check_output_folder
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.levels import NOT_VERIFIED, check_verify_level
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers.hf_folder import write_hf_shards
from ckpt_tools.io.writers.output import Check
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.safetensors import (
    SafetensorsEntry,
    check_holdable,
    copied_bytes,
    source_records,
)
from ckpt_tools.io.writers.shard_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    ShardPlan,
    parse_shard_size,
    plan_shards,
)
from ckpt_tools.ops.output_plan import PlannedFile, dry_run_fields, planned_shard_files
from ckpt_tools.ops.preflight import check_key_types, check_rewritable
from ckpt_tools.ops.rewrite.plan import safetensors_plan, torch_instead
from ckpt_tools.ops.rewrite.result import RewriteResult
from ckpt_tools.ops.transform.tied_names import hf_shared_names, same_view
from ckpt_tools.structure.selection import holds_no_state_dict, select_state_dict

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "convert_to_folder", "reshard"]


def convert_to_folder(
    src: StrPath,
    dst: StrPath,
    *,
    max_shard_size: str | int | None = None,
    output_format: OutputFormat | None = None,
    select: Select = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
    jobs: int = 1,
) -> RewriteResult:
    """Write a checkpoint's state dict as a Hugging Face sharded safetensors folder.

    What :func:`~ckpt_tools.ops.rewrite.conversion.convert` does for a folder output.

    Args:
        src: a ``.pt``, ``.safetensors`` or sharded folder.
        dst: the output folder; it must not exist, or be empty, unless ``force``.
        max_shard_size: the shard limit (``"5GB"`` = 5*10**9, ``"2GiB"``, or bytes); None:
            ``"5GB"``, as ``huggingface_hub``.
        output_format: None or ``safetensors`` (a folder holds safetensors shards).
        select: dotted path to the state dict; chosen automatically when None.
        drop_extras: leave out non-tensor entries instead of refusing.
        allow_globals: qualified names outside the allowlist to accept.
        force: write into a non-empty ``dst``: its weight files (``model*.safetensors``,
            ``pytorch_model*.bin`` and their index) are replaced, everything else in it
            (config, tokenizer files, subfolders) is kept. Never the input, nor a folder
            holding it.
        verify: ``sizes`` (default: read every shard back, keys, dtypes, shapes, sizes),
            ``full`` (also every byte of the state dict's tensors, compared with the input's) or
            ``none``.
        durable: fsync every file and the folders before the folder is named (default);
            False skips it, as ``cp`` does (see :func:`~ckpt_tools.io.atomic.atomic_output`).
        dry_run: plan and check everything (refusals included), write nothing, create no
            folder: the result's ``planned`` lists each shard, its tensors, and the index.
        progress: called with ``(done_bytes, total_bytes)`` as tensor bytes are written
            (:data:`~ckpt_tools._types.Progress`).
        jobs: shards written at once, by threads (see
            :func:`~ckpt_tools.io.writers.hf_folder.write_folder`).

    Returns:
        A :class:`~ckpt_tools.ops.rewrite.result.RewriteResult` (``written``: the shards, then
        the index if any; ``dropped``: tied tensors stored once, whose kept name is in the
        metadata, and with ``drop_extras`` non-tensor entries; ``max_shard_size``: the limit).

    Raises:
        UsageError: a bad ``max_shard_size``, ``verify``, ``jobs`` or ``output_format``;
            ``allow_globals`` not a str or a sequence of str.
        NonTensorEntriesError: non-tensor entries and not ``drop_extras`` (exit 7).
        ConversionError: tied tensors with no complete name, or dtypes safetensors lacks.
        OutputExistsError / OutputError: the output is refused (exit 6).

    Example:
        >>> convert_to_folder("model.pt", "model-hf", max_shard_size="1GB").written
        ('model-hf/model.safetensors',)
        >>> result = convert_to_folder("model.pt", "model-hf", max_shard_size="1KB", force=True)
        >>> len(result.written) > 2
        True
    """
    _check_options(dst, verify, jobs, output_format)
    limit = parse_shard_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    allow_globals = str_items(allow_globals, "allow_globals")
    src, dst = os.fspath(src), os.fspath(dst)
    target = check_output_folder(dst, src, force=force)
    ckpt = open_checkpoint(src)
    folder = _plan_folder(ckpt, select, drop_extras, allow_globals, limit, target)
    shared = {
        "src": src,
        "dst": dst,
        "input_format": ckpt.format,
        "output_format": "hf-sharded",
        "bytes_written": folder.shards.total_size,
        "bytes_copied": copied_bytes(folder.entries),
        "dropped": folder.dropped,
        "selected": folder.selected,
        "tensors": len(folder.entries),
        "total_keys": folder.total_keys,
        "max_shard_size": limit,
    }
    count = len(folder.shards.files)
    if dry_run:
        message = (
            f"dry run: would convert {ckpt.format} to {count} safetensors shard(s) in {dst} "
            f"({folder.shards.total_size} tensor bytes)"
        )
        tensors = {e.name: e.tensor for e in folder.entries}
        planned = planned_shard_files(dst, tensors, folder.shards, folder.metadata)
        return RewriteResult(**shared, **dry_run_fields(dst, planned), message=message)
    counter = ByteCounter(progress, folder.shards.total_size)
    by_name = {e.name: e.tensor for e in folder.entries}

    def check(names: Sequence[str]) -> Check:
        expected = Expected({n: by_name[n] for n in names}, (), ckpt)
        return lambda path: verify_output(path, expected, verify)

    names = write_hf_shards(
        source_records(folder.entries, ckpt),
        target,
        folder.shards,
        check,
        metadata=folder.metadata,
        counter=counter,
        jobs=jobs,
        durable=durable,
        replace=force,
    )
    return RewriteResult(
        **shared,
        written=tuple(os.path.join(dst, name) for name in names),
        verification=f"verified ({verify})" if verify != "none" else NOT_VERIFIED,
        message=f"converted {ckpt.format} to {count} safetensors shard(s): wrote {dst}",
    )


def _check_options(dst: StrPath, verify: str, jobs: int, output_format: str | None) -> None:
    """``convert_to_folder``'s arguments checked, before anything is read."""
    check_verify_level(verify)
    count_of(jobs, "jobs", flag="--jobs")
    if output_format not in (None, "safetensors"):
        raise UsageError(
            f"{os.fspath(dst)!r} is a folder output, which holds safetensors shards",
            argument="output_format",
            value=repr(output_format),
            flag="--format",
            remedies=(Remedy(text="name a file (such as 'model.pt') for a torch output"),),
        )


class _FolderPlan(NamedTuple):
    """A folder output planned: its tensors, the index's metadata, what is left out, the shards."""

    entries: list[SafetensorsEntry]
    metadata: dict[str, str]
    dropped: tuple[str, ...]
    shards: ShardPlan
    selected: tuple[str, ...]
    total_keys: int


def _plan_folder(
    ckpt: Checkpoint,
    select: Select,
    drop_extras: bool,
    allow_globals: Sequence[str],
    limit: int,
    target: Path,
) -> _FolderPlan:
    """Everything ``convert_to_folder`` refuses, checked; then the shards it writes."""
    selection = select_state_dict(ckpt.root, select=select)
    check_rewritable(ckpt, allow_globals, selection.path, "safetensors")  # shards hold them
    if selection.stand_in:  # a bare tensor, a list: nothing names its tensors
        raise ConversionError(
            f"{holds_no_state_dict(repr(ckpt.path), ckpt.root)}; safetensors shards hold "
            "named tensors",
            remedies=(torch_instead(target, folder=True),),
        )
    sd = selection.state_dict
    check_key_types(sd, (), "safetensors", ckpt.path)
    tensors = {k: v for k, v in sd.items() if isinstance(v, TensorRef)}
    # A name is left to the index's metadata only where it is its kept name's very view: the
    # note says which name, not which view, so a partial view is written as its own tensor.
    aliases = {
        name: kept
        for name, kept in hf_shared_names(tensors).items()
        if same_view(tensors[name], tensors[kept])
    }
    kept = {k: v for k, v in sd.items() if k not in aliases}
    entries, metadata, dropped, _ = safetensors_plan(ckpt, selection.path, kept, drop_extras)
    extra, ties = _carried_metadata(metadata, {str(k) for k in sd})
    extra.update(tie_metadata({**ties, **aliases}, beside={**extra, "format": "pt"}))
    check_holdable([(e.name, e.tensor) for e in entries], ckpt.path)
    check_output_size([e.tensor for e in entries], sum(e.tensor.nbytes for e in entries), target)
    for e in entries:
        ckpt.check_span(e.tensor.storage)  # one that cannot be copied is refused before writing
    shards = plan_shards([(e.name, e.tensor.nbytes) for e in entries], limit)
    dropped_names = tuple(aliases) + dropped
    return _FolderPlan(entries, extra, dropped_names, shards, selection.path, len(sd))


def _carried_metadata(
    metadata: Mapping[str, Any], names: set[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """The planned metadata split into what carries over and the plan's own ties.

    The input's entries whose key or value is a tensor name (a stale tie note, or a note
    other tools would take for one) are left out; ``total_size`` and ``format`` are the
    writer's to set; the ties the plan recorded (:data:`TIES_KEY`) are returned apart, to be
    recorded again with the folder's own."""
    ties = json.loads(metadata.get(TIES_KEY, "{}"))
    carried = {
        k: v
        for k, v in metadata.items()
        if isinstance(v, str)
        and k not in ("format", "total_size", TIES_KEY)
        and k not in ties
        and not (k in names or v in names)
    }
    return carried, ties


@checked_flags
def reshard(
    src: StrPath,
    dst: StrPath,
    *,
    max_shard_size: str | int | None = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
    jobs: int = 1,
) -> RewriteResult:
    """Rewrite a Hugging Face sharded folder with another shard size (``ckpt reshard``).

    Args:
        src: the sharded folder (or its ``*.index.json``).
        dst: the output folder (not ``src``, which is never touched).
        max_shard_size: the new limit (``"5GB"`` = 5*10**9, ``"2GiB"``, or bytes); None:
            ``"5GB"``.
        drop_extras, allow_globals: as for :func:`~ckpt_tools.convert` to a folder; a folder
            of ``pytorch_model*.bin`` shards may hold non-tensor entries and other globals.
        force, verify, durable, dry_run, progress, jobs: as for :func:`~ckpt_tools.convert`.

    Returns:
        A :class:`~ckpt_tools.ops.rewrite.result.RewriteResult`.

    Raises:
        UsageError: ``src`` is a URL or not a folder of shards, or ``jobs`` < 1.
        NonTensorEntriesError: non-tensor entries and not ``drop_extras`` (exit 7).
        UnsafeContentError: globals outside the allowlist, not allowed (exit 3).
        OutputExistsError / OutputError: the output is refused (exit 6).

    Example:
        >>> reshard("sharded", "one-shard", max_shard_size="1GB").written
        ('one-shard/model.safetensors',)
    """
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    refuse_url(src)  # before the folder test, whose remedy would name it
    if not (os.path.isdir(src) or is_index_name(src)):
        detect_format(src)  # nothing there, a FIFO: refused as every reader refuses it
        raise UsageError(
            f"{src!r} is not a sharded folder; reshard reads a folder of safetensors shards",
            path=src,
            remedies=(
                Remedy(command=f"ckpt convert {shell_path(src)} OUT_DIR/ --max-shard-size SIZE"),
            ),
        )
    result = convert_to_folder(
        src,
        dst,
        max_shard_size=max_shard_size,
        drop_extras=drop_extras,
        allow_globals=allow_globals,
        force=force,
        verify=verify,
        progress=progress,
        jobs=jobs,
        dry_run=dry_run,
        durable=durable,
    )
    files = result.planned if dry_run else result.written
    names = [f.name if isinstance(f, PlannedFile) else f for f in files]
    shards = sum(1 for name in names if name.endswith(".safetensors"))
    if dry_run:
        said = f"dry run: would reshard into {shards} shard(s) in {result.dst}"
        return replace(result, message=said)
    return replace(result, message=f"resharded into {shards} shard(s): wrote {result.dst}")
