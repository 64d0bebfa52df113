"""Hugging Face sharded folders as outputs: ``convert`` to a folder, and ``reshard``.

Any checkpoint ``convert`` reads (a ``.pt``, a ``.safetensors``, an HF folder) becomes a
folder of ``model-0000k-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``,
bytes copied record by record (:mod:`ckpt_tools.io.writers.hf_folder`). Tied tensors are stored
once, by ``huggingface_hub.save_torch_state_dict``'s rule
(:func:`~ckpt_tools.ops.transform.tied_names.hf_shared_names`). torch
is never imported.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import TORCH_TO_SAFETENSORS
from ckpt_tools.errors import ConversionError, Remedy, UsageError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.io.writers.hf_folder import check_output_folder, write_hf_shards
from ckpt_tools.io.writers.shard_plan import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_NAME,
    ShardPlan,
    index_bytes,
    parse_shard_size,
    plan_shards,
)
from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor, plan_json, planned_text
from ckpt_tools.ops.preflight import check_key_types, check_rewritable
from ckpt_tools.ops.rewrite.plan import safetensors_plan
from ckpt_tools.ops.transform.tied_names import hf_shared_names
from ckpt_tools.structure.selection import select_state_dict
from ckpt_tools.structure.text import Readable, human_bytes

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "ShardsResult",
    "convert_to_folder",
    "reshard",
]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ShardsResult(Readable):
    """What writing a sharded folder did.

    Attributes:
        src: the input.
        dst: the output folder.
        input_format: format of the input.
        files: the files written inside ``dst`` (shards, then the index if any).
        tensors: tensors written.
        total_size: bytes of tensor data written (the index's ``total_size``).
        max_shard_size: the shard limit, in bytes.
        dropped: names left out: tied tensors stored once (their kept name is in the
            metadata) and, with ``drop_extras``, non-tensor entries.
        verification: what was verified.
        message: a one-line summary.
        written: False for a dry run (``files`` are then the files it would write).
        planned: with ``dry_run``, every file it would write and the tensors in it.
    """

    src: str
    dst: str
    input_format: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    max_shard_size: int
    dropped: tuple[str, ...] = ()
    verification: str = ""
    message: str = ""
    written: bool = True
    planned: tuple[PlannedFile, ...] = ()

    def text(self) -> str:
        """The summary, the files, and what was left out."""
        listed = [f"  {name}" for name in self.files]
        lines = [self.message, *(planned_text(self.planned) if not self.written else listed)]
        if self.dropped:
            lines.append(f"left out: {', '.join(self.dropped[:8])}")
        if not self.written:
            return "\n".join(lines)
        lines.append(f"{human_bytes(self.total_size)} of tensors copied; {self.verification}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict of every field."""
        return {
            "src": self.src,
            "dst": self.dst,
            "input_format": self.input_format,
            "output_format": "hf-sharded",
            "files": list(self.files),
            "tensors": self.tensors,
            "total_size": self.total_size,
            "max_shard_size": self.max_shard_size,
            "dropped": list(self.dropped),
            "verification": self.verification,
            "message": self.message,
            "written": self.written,
            "dry_run": not self.written,
            **(plan_json(self.planned) if not self.written else {}),
        }


def _check_dtypes(entries: Sequence[Any], src: str) -> None:
    """Refuse, before any shard is written, every tensor whose dtype safetensors lacks."""
    bad = [
        f"{e.name} ({e.tensor.dtype})"
        for e in entries
        if e.tensor.dtype not in TORCH_TO_SAFETENSORS
    ]
    if bad:
        raise ConversionError(
            f"safetensors cannot hold the dtype of {len(bad)} tensor(s) in {src!r}: "
            + ", ".join(bad[:8])
            + (" ..." if len(bad) > 8 else ""),
            path=src,
            remedies=(Remedy(text="keep the torch format"),),
        )


def convert_to_folder(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    *,
    select: str | Sequence[str] | None = None,
    drop_extras: bool = False,
    force: bool = False,
    verify: str = "sizes",
    allow_globals: Sequence[str] = (),
    progress: Progress | None = None,
    jobs: int = 1,
    dry_run: bool = False,
    durable: bool = True,
) -> ShardsResult:
    """Write a checkpoint's state dict as a Hugging Face sharded safetensors folder.

    Args:
        src: a ``.pt``, ``.safetensors`` or sharded folder.
        dst: the output folder; it must not exist, or be empty, unless ``force``.
        max_shard_size: the shard limit (``"5GB"`` = 5*10**9, ``"2GiB"``, or bytes).
        select: dotted path to the state dict; chosen automatically when None.
        drop_extras: leave out non-tensor entries instead of refusing.
        force: replace a non-empty ``dst`` (never a folder holding the input).
        verify: ``sizes`` (default), ``full`` (compare bytes) or ``none``, for every shard.
        allow_globals: qualified names outside the allowlist to accept.
        progress: called with ``(bytes_done, bytes_total)``.
        jobs: shards written at once, by threads (see
            :func:`~ckpt_tools.io.writers.hf_folder.write_hf_shards`).
        dry_run: plan and check everything (refusals included), write nothing, create no
            folder: ``planned`` lists each shard, its tensors, and the index.
        durable: fsync the files and folders (default); False skips it, as ``cp`` does.

    Returns:
        A :class:`ShardsResult`.

    Raises:
        UsageError: a bad ``max_shard_size``, ``verify`` or ``jobs``.
        NonTensorEntriesError: non-tensor entries and not ``drop_extras`` (exit 7).
        ConversionError: tied tensors with no complete name, or dtypes safetensors lacks.
        OutputExistsError / OutputError: the output is refused (exit 6).

    Example:
        >>> convert_to_folder("model.pt", "model-hf", "1GB").files
        ('model.safetensors',)
        >>> len(convert_to_folder("model.pt", "model-hf", "1KB", force=True).files) > 2
        True
    """
    check_verify_level(verify)
    if jobs < 1:
        raise UsageError("must be at least 1", argument="jobs", value=repr(jobs), flag="--jobs")
    limit = parse_shard_size(max_shard_size)
    src, dst = os.fspath(src), os.fspath(dst)
    target = check_output_folder(dst, src, force=force)
    ckpt = open_checkpoint(src)
    selection = select_state_dict(ckpt.root, select)
    check_rewritable(ckpt, allow_globals, selection.path)
    sd = selection.state_dict
    check_key_types(sd, (), "safetensors", src)
    tensors = {k: v for k, v in sd.items() if isinstance(v, TensorRef)}
    aliases = hf_shared_names(tensors)
    kept = {k: v for k, v in sd.items() if k not in aliases}
    entries, metadata, dropped, _ = safetensors_plan(ckpt, selection.path, kept, drop_extras)
    # The source's string metadata carries over (an HF index's alias notes among it); its
    # total_size and "format" are the writer's to set.
    extra = {k: v for k, v in metadata.items() if isinstance(v, str) and k != "format"}
    extra.update(aliases)
    _check_dtypes(entries, src)
    check_output_size([e.tensor for e in entries], sum(e.tensor.nbytes for e in entries), target)
    for e in entries:
        ckpt.span(e.tensor.storage)  # a storage that cannot be copied is refused before writing
    plan = plan_shards([(e.name, e.tensor.nbytes) for e in entries], limit)
    if dry_run:
        planned = _planned_files(entries, plan, extra)
        return ShardsResult(
            src=src,
            dst=dst,
            input_format=ckpt.format,
            files=tuple(f.name for f in planned),
            tensors=len(entries),
            total_size=plan.total_size,
            max_shard_size=limit,
            dropped=tuple(aliases) + dropped,
            message=f"dry run: would convert {ckpt.format} to {len(plan.files)} safetensors "
            f"shard(s) in {dst} ({plan.total_size} tensor bytes); nothing written",
            written=False,
            planned=planned,
        )
    done = [0]
    lock = threading.Lock()  # shards may be written by several threads

    def on_bytes(n: int) -> None:
        with lock:
            done[0] += n
            if progress is not None:
                progress(done[0], plan.total_size)

    files = write_hf_shards(
        entries,
        ckpt,
        target,
        plan,
        metadata=extra,
        verify=verify,
        progress=on_bytes,
        jobs=jobs,
        durable=durable,
    )
    shards = len(plan.files)
    return ShardsResult(
        src=src,
        dst=dst,
        input_format=ckpt.format,
        files=files,
        tensors=len(entries),
        total_size=plan.total_size,
        max_shard_size=limit,
        dropped=tuple(aliases) + dropped,
        verification=f"verified ({verify})" if verify != "none" else "not verified",
        message=f"converted {ckpt.format} to {shards} safetensors shard(s): wrote {dst}",
    )


def _planned_files(
    entries: Sequence[Any], plan: ShardPlan, metadata: Mapping[str, str]
) -> tuple[PlannedFile, ...]:
    """The shards ``plan`` lays out, their tensors, and the index (its exact bytes)."""
    by_name = {
        e.name: PlannedTensor(e.name, e.tensor.dtype, e.tensor.shape, e.tensor.nbytes)
        for e in entries
    }
    files = [PlannedFile.of(file, (by_name[n] for n in names)) for file, names in plan.files]
    if plan.is_sharded:
        files.append(PlannedFile(INDEX_NAME, (), len(index_bytes(plan, metadata))))
    return tuple(files)


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    *,
    force: bool = False,
    verify: str = "sizes",
    progress: Progress | None = None,
    jobs: int = 1,
    dry_run: bool = False,
    durable: bool = True,
) -> ShardsResult:
    """Rewrite a Hugging Face sharded folder with another shard size (``ckpt reshard``).

    Args:
        src: the sharded folder (or its ``*.index.json``).
        dst: the output folder (not ``src``, which is never touched).
        max_shard_size: the new limit (``"5GB"`` = 5*10**9, ``"2GiB"``, or bytes).
        force: replace a non-empty ``dst``.
        verify: ``sizes`` (default), ``full`` or ``none``, for every shard.
        progress: called with ``(bytes_done, bytes_total)``.
        jobs: shards written at once (threads).
        dry_run: plan only, as :func:`convert_to_folder`; nothing is written.
        durable: as :func:`convert_to_folder`'s (False skips the fsyncs).

    Returns:
        A :class:`ShardsResult`.

    Raises:
        UsageError: ``src`` is not a folder of shards, or ``jobs`` < 1.
        OutputExistsError / OutputError: the output is refused (exit 6).

    Example:
        >>> reshard("sharded", "one-shard", "1GB").files
        ('model.safetensors',)
    """
    src = os.fspath(src)
    if not (os.path.isdir(src) or src.endswith(".index.json")):
        raise UsageError(
            f"{src!r} is not a sharded folder; reshard reads a folder of safetensors shards",
            path=src,
            remedies=(Remedy(command=f"ckpt convert {src} OUT_DIR/ --max-shard-size SIZE"),),
        )
    result = convert_to_folder(
        src,
        dst,
        max_shard_size,
        force=force,
        verify=verify,
        progress=progress,
        jobs=jobs,
        dry_run=dry_run,
        durable=durable,
    )
    shards = sum(1 for f in result.files if f.endswith(".safetensors"))
    if dry_run:
        said = f"dry run: would reshard into {shards} shard(s) in {result.dst}; nothing written"
        return replace(result, message=said)
    return replace(result, message=f"resharded into {shards} shard(s): wrote {result.dst}")
