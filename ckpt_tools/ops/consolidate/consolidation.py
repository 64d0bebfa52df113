"""``consolidate``: a DCP folder into one ``.pt``, one ``.safetensors``, or HF shards.

Bytes move chunk by chunk (:mod:`ckpt_tools.io.assemble`): dim-0 slices with
``copy_file_range`` straight into place, other layouts through a bounded numpy slab. Peak
memory does not grow with the checkpoint, and torch is never imported. Every file is
written atomically and read back before it is named (:mod:`ckpt_tools.io.atomic`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckpt_tools.errors import UsageError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.io.atomic import check_output_path
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.io.writers.shard_plan import DEFAULT_MAX_SHARD_SIZE, index_bytes, parse_shard_size
from ckpt_tools.ops.consolidate.plan import ConsolidationPlan, plan_consolidation
from ckpt_tools.ops.consolidate.write import shard_outputs, write_file, write_shards
from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor, plan_json, planned_text
from ckpt_tools.structure.text import Readable, human_bytes

__all__ = ["CONSOLIDATE_VERIFY_LEVELS", "ConsolidateResult", "consolidate"]

#: What consolidate's verification offers: ``sizes`` reads every output back (keys, dtypes,
#: shapes, layout); there is no ``full``.
CONSOLIDATE_VERIFY_LEVELS = ("sizes", "none")

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True)
class ConsolidateResult(Readable):
    """What :func:`consolidate` wrote.

    Attributes:
        src: the DCP folder.
        dst: the output file or folder.
        output_format: ``torch-zip``, ``safetensors`` or ``hf-sharded``.
        files: the files written (for HF shards: the shards, then the index).
        tensors: how many tensors were written.
        total_bytes: their bytes.
        copied_bytes: bytes copied in the kernel (dim-0 chunks); the rest were assembled.
        selected: the path of the state dict written (empty with ``all``).
        dropped: non-tensor entries left out (safetensors outputs).
        renamed: how many keys ``strip`` changed.
        verification: what was verified.
        written: False for a dry run (``files`` are then the files it would write).
        planned: with ``dry_run``, every file it would write and its tensors.
    """

    src: str
    dst: str
    output_format: str
    files: tuple[str, ...]
    tensors: int
    total_bytes: int
    copied_bytes: int
    selected: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    renamed: int = 0
    verification: str = ""
    written: bool = True
    planned: tuple[PlannedFile, ...] = ()

    def text(self) -> str:
        """What ``ckpt consolidate`` prints.

        Example:
            >>> r = ConsolidateResult("ckpt", "model.pt", "torch-zip", ("model.pt",), 2, 64, 64, ())
            >>> print(r)
            consolidated ckpt -> model.pt (torch-zip): 2 tensors, 64 B (64 B copied in the kernel)
        """
        where = "the whole checkpoint" if not self.selected else ".".join(self.selected)
        done = "consolidated" if self.written else "dry run: would consolidate"
        lines = [
            f"{done} {self.src} -> {self.dst} ({self.output_format}): {self.tensors} "
            f"tensors, {human_bytes(self.total_bytes)} ({human_bytes(self.copied_bytes)} "
            "copied in the kernel)"
        ]
        if self.selected:
            lines.append(f"state dict: {where}")
        if len(self.files) > 1:
            lines.append(f"files: {len(self.files)} ({self.files[0]} ... {self.files[-1]})")
        if self.renamed:
            lines.append(f"stripped wrapper prefixes from {self.renamed} keys")
        if self.dropped:
            lines.append(f"left out (not tensors): {', '.join(self.dropped[:8])}")
        if self.verification:
            lines.append(self.verification)
        if not self.written:
            lines += [*planned_text(self.planned), "nothing written"]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "output_format": self.output_format,
            "files": list(self.files),
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "copied_bytes": self.copied_bytes,
            "selected": list(self.selected),
            "dropped": list(self.dropped),
            "renamed": self.renamed,
            "verification": self.verification,
            "written": self.written,
            "dry_run": not self.written,
            **(plan_json(self.planned) if not self.written else {}),
        }


def _output_format(dst: str) -> str:
    if dst.endswith(".safetensors"):
        return "safetensors"
    if dst.endswith(_TORCH_SUFFIXES):
        return "torch-zip"
    if os.path.isfile(dst):
        raise UsageError(
            f"output {dst!r} is a file without a .pt or .safetensors suffix; name a .pt, "
            "a .safetensors, or a folder for Hugging Face shards",
            argument="dst",
            value=dst,
        )
    return "hf-sharded"


def consolidate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    select: str | None = None,
    all: bool = False,
    strip: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    jobs: int = 1,
    force: bool = False,
    verify: str = "sizes",
    dry_run: bool = False,
    durable: bool = True,
) -> ConsolidateResult:
    """Write a torch.distributed.checkpoint folder as one file or as HF shards, torch-free.

    Args:
        src: the DCP folder (``.metadata`` and ``*.distcp`` files).
        dst: a ``.pt`` (torch.save format), a ``.safetensors``, or a folder for Hugging
            Face shards (``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``).
        select: the state dict to write (a dotted path, e.g. ``"model"``); None picks it as
            ``inspect`` does.
        all: write everything saved (model, optimizer, other entries), nested as saved.
        strip: remove wrapper prefixes (``module.``, ``_orig_mod.``) from the state dict's keys.
        max_shard_size: the most bytes per HF shard (``"5GB"``, decimal units, or an int).
        jobs: how many HF shards to write at once.
        force: replace existing output files.
        verify: ``sizes`` (read every output back: keys, dtypes, shapes, layout) or ``none``.
        dry_run: plan and check everything (refusals included), write nothing: the result's
            ``planned`` lists each file, its tensors, dtypes, shapes and sizes.
        durable: fsync every output before naming it (default); False skips it, as ``cp``
            does (see :func:`~ckpt_tools.io.atomic.atomic_output`).

    Returns:
        The :class:`ConsolidateResult`.

    Raises:
        UsageError: ``src`` is not a DCP folder, or bad arguments.
        CorruptCheckpointError: the folder's metadata or chunks are malformed (nothing written).
        OutputError: an output exists (without ``force``) or could not be written.

    Example:
        >>> import warnings, torch, torch.distributed.checkpoint as dcp
        >>> with warnings.catch_warnings():  # (saving without a process group warns)
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"model": {"fc.weight": torch.ones(2, 3)}}, checkpoint_id="run")
        >>> print(consolidate("run", "m.safetensors"))
        consolidated run -> m.safetensors (safetensors): 1 tensors, 24 B (24 B copied in the kernel)
        state dict: model
        verified: keys and sizes
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if jobs < 1:
        raise UsageError("jobs must be at least 1", argument="jobs", value=jobs)
    check_verify_level(verify, CONSOLIDATE_VERIFY_LEVELS)
    ckpt = open_checkpoint(src)
    if not isinstance(ckpt, DcpCheckpoint):
        raise UsageError(
            f"{src!r} is a {ckpt.format} checkpoint, not a torch.distributed.checkpoint folder "
            "(a .metadata file and *.distcp files)",
            argument="src",
            value=src,
        )
    fmt = _output_format(dst)
    limit = parse_shard_size(max_shard_size)
    plan = plan_consolidation(
        ckpt, select=select, everything=all, strip=strip, tensors_only=fmt != "torch-zip"
    )
    if dry_run:
        return _planned(src, dst, fmt, plan, limit, force)
    if fmt == "hf-sharded":
        files = write_shards(plan, dst, limit, jobs, force, verify, durable)
    else:
        check_output_path(dst, src, force=force)
        write_file(dst, fmt, plan, verify, durable)
        files = (dst,)
    return ConsolidateResult(
        src=src,
        dst=dst,
        output_format=fmt,
        files=files,
        tensors=len(plan.tensors),
        total_bytes=sum(t.tensor.nbytes for t in plan.tensors),
        copied_bytes=sum(t.copied for t in plan.tensors),
        selected=plan.selected,
        dropped=plan.dropped,
        renamed=len(plan.renamed),
        verification="not verified (verify='none')"
        if verify == "none"
        else "verified: keys and sizes",
    )


def _planned(
    src: str, dst: str, fmt: str, plan: ConsolidationPlan, limit: int, force: bool
) -> ConsolidateResult:
    """The result of a dry run: the files the plan would write, refused as a write would be."""
    tensors = {
        t.name: PlannedTensor(t.name, t.tensor.dtype, t.tensor.shape, t.tensor.nbytes)
        for t in plan.tensors
    }
    if fmt == "hf-sharded":
        shards, paths, _ = shard_outputs(plan, dst, limit, force)
        planned = [
            PlannedFile.of(path, (tensors[n] for n in names))
            for path, (_, names) in zip(paths, shards.files)
        ]
        if shards.is_sharded:
            planned.append(PlannedFile(paths[-1], (), len(index_bytes(shards))))
    else:
        check_output_path(dst, src, force=force)
        planned = [PlannedFile.of(dst, tensors.values())]
    return ConsolidateResult(
        src=src,
        dst=dst,
        output_format=fmt,
        files=tuple(f.name for f in planned),
        tensors=len(plan.tensors),
        total_bytes=sum(t.tensor.nbytes for t in plan.tensors),
        copied_bytes=sum(t.copied for t in plan.tensors),
        selected=plan.selected,
        dropped=plan.dropped,
        renamed=len(plan.renamed),
        written=False,
        planned=tuple(planned),
    )
