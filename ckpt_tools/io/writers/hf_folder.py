"""Folder outputs: Hugging Face sharded folders, as :mod:`~ckpt_tools.io.writers.shard_plan`
lays them out.

The folder is written as a whole: every file by :func:`~ckpt_tools.io.writers.output.write_file`
(atomic, verified), inside a temp folder beside the target, which is renamed into place only
once all of it is complete. A folder it replaces passes on its permission bits (setgid
included), its owner and group where the process may set them, and each replaced file's mode
to the new file of that name; a symlink at the target is kept, and its folder replaced.
torch is never imported.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.io.atomic import AtomicFile
from ckpt_tools.io.output_path import resolved_output
from ckpt_tools.io.writers.folder_swap import published_folder
from ckpt_tools.io.writers.folder_temp import StopCounter, Stopped, run_jobs
from ckpt_tools.io.writers.output import Check, Fill, write_file
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import Record
from ckpt_tools.io.writers.safetensors import write_safetensors
from ckpt_tools.io.writers.shard_plan import INDEX_NAME, ShardPlan, index_bytes

__all__ = ["FolderFile", "write_folder", "write_hf_shards"]


class FolderFile(NamedTuple):
    """One file of a folder output: its name inside the folder, what writes it, what checks it."""

    name: str
    fill: Fill
    check: Check


def write_folder(
    dst: str | os.PathLike[str],
    files: Sequence[FolderFile],
    *,
    jobs: int = 1,
    durable: bool = True,
    replace: bool = False,
) -> tuple[str, ...]:
    """Write ``files`` into a temp folder beside ``dst``, each by :func:`write_file`, then
    publish the folder as ``dst`` by one rename.

    Args:
        dst: the output folder, checked first with
            :func:`~ckpt_tools.io.output_path.check_output_folder`; a symlink there is kept,
            and the folder it points to replaced.
        files: the files, in order.
        jobs: files written at once, by threads. SIGTERM and SIGHUP are handled as with one:
            the main thread stops the workers (each at its next piece), removes the temp
            folder, and raises :class:`~ckpt_tools.io.interrupts.Interrupted`.
        durable: fsync every file and the folders (default); False skips those fsyncs
            (see :func:`~ckpt_tools.io.atomic.atomic_output`), unless a non-empty ``dst``
            is replaced.
        replace: write into a non-empty ``dst`` (the caller's ``force``); False refuses
            one, even one filled after
            :func:`~ckpt_tools.io.output_path.check_output_folder` accepted it.

    Returns:
        The names written inside ``dst``, in order.

    Raises:
        OutputExistsError: ``dst`` is not empty and ``replace`` is False.
        OutputError / VerificationError: writing or checking failed; ``dst`` is untouched.
    """
    return _write_folder(dst, files, jobs, durable, threading.Event(), replace)


def _write_folder(
    dst: str | os.PathLike[str],
    files: Sequence[FolderFile],
    jobs: int,
    durable: bool,
    stop: threading.Event,
    replace: bool,
) -> tuple[str, ...]:
    """:func:`write_folder`, with the stop event its files' writers watch (see
    :mod:`~ckpt_tools.io.writers.folder_temp`)."""
    target = resolved_output(dst)
    with published_folder(target, durable, replace) as (tmp, durable):

        def write_one(f: FolderFile) -> str:
            if stop.is_set():
                raise Stopped("the folder write is stopping")
            # The shard it replaces lends it its mode and owner.
            write_file(tmp / f.name, f.fill, f.check, durable=durable, like=target / f.name)
            return f.name

        if jobs > 1 and len(files) > 1:
            # copy_file_range and fsync release the GIL: files overlap their disk waits.
            return run_jobs(write_one, files, jobs, stop)
        return tuple(write_one(f) for f in files)


def write_hf_shards(
    entries: Sequence[tuple[str, TensorRef, Record]],
    dst: str | os.PathLike[str],
    plan: ShardPlan,
    check: Callable[[Sequence[str]], Check],
    *,
    metadata: Mapping[str, str] | None = None,
    counter: ByteCounter | None = None,
    jobs: int = 1,
    durable: bool = True,
    replace: bool = False,
) -> tuple[str, ...]:
    """Write ``entries`` as the Hugging Face folder ``plan`` lays out, then publish it.

    Each shard is written by :func:`~ckpt_tools.io.writers.safetensors.write_safetensors`
    with ``{"format": "pt"}`` metadata. ``metadata`` (the dropped names of tied tensors,
    say) goes into the index when there is one, else into the single file, as
    huggingface_hub does.

    Args:
        entries: ``(name, tensor, record)`` of every name of ``plan``, once.
        dst: the output folder, checked first with
            :func:`~ckpt_tools.io.output_path.check_output_folder`.
        plan: from :func:`~ckpt_tools.io.writers.shard_plan.plan_shards` over these entries.
        check: given a shard's tensor names, the verification of that shard.
        metadata: extra string metadata.
        counter: told the byte count of every piece written (from several threads when
            ``jobs`` > 1).
        jobs, durable, replace: as for :func:`write_folder`.

    Returns:
        The files written (shards, then the index), names inside ``dst``.

    Raises:
        ConversionError: a dtype safetensors cannot hold.
        OutputExistsError: ``dst`` is not empty and ``replace`` is False.
        OutputError / VerificationError: writing or verifying failed; ``dst`` is untouched.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> from ckpt_tools.io.writers.safetensors import SafetensorsEntry, source_records
        >>> from ckpt_tools.io.writers.shard_plan import plan_shards
        >>> ckpt = open_checkpoint("model.safetensors")
        >>> entries = source_records([SafetensorsEntry(k, t) for k, t in ckpt.root.items()], ckpt)
        >>> plan = plan_shards([(name, r.nbytes) for name, _, r in entries], 1000)
        >>> write_hf_shards(entries, "model-hf", plan, lambda names: lambda path: "")[-1]
        'model.safetensors.index.json'
    """
    by_name = {entry[0]: entry for entry in entries}
    extra = {str(k): str(v) for k, v in (metadata or {}).items()}
    shard_meta = {"format": "pt"} if plan.is_sharded else {**extra, "format": "pt"}
    stop = threading.Event()
    watched = StopCounter(counter, stop)  # workers stop at their next piece once it is set

    def shard(file: str, names: Sequence[str]) -> FolderFile:
        def fill(out: AtomicFile) -> None:
            part = [by_name[n] for n in names]
            write_safetensors(part, out.file, shard_meta, watched, durable=out.durable)

        return FolderFile(file, fill, check(names))

    files = [shard(file, names) for file, names in plan.files]
    if plan.is_sharded:
        index = index_bytes(plan, extra)
        files.append(FolderFile(INDEX_NAME, lambda out: out.file.write(index), lambda path: ""))
    return _write_folder(dst, files, jobs, durable, stop, replace)
