"""merge-lora into a Hugging Face folder: the safetensors plan's entries written as shards.

The plan is the one a ``.safetensors`` output takes (tied tensors stored once, their names
in the metadata); :func:`~ckpt_tools.io.writers.hf_folder.write_hf_shards` lays it out in
shards of at most ``max_shard_size`` and publishes the folder with one rename.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ckpt_tools._types import Progress, VerifyLevel
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.verify.levels import NOT_VERIFIED, check_verify_level
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers.hf_folder import write_hf_shards
from ckpt_tools.io.writers.output import Check
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import check_records
from ckpt_tools.io.writers.shard_plan import DEFAULT_MAX_SHARD_SIZE, parse_shard_size, plan_shards
from ckpt_tools.ops.output_plan import dry_run_fields, planned_shard_files
from ckpt_tools.ops.transform.plan import TransformPlan
from ckpt_tools.ops.transform.result import TransformResult

__all__ = ["write_merged_folder"]


def write_merged_folder(
    plan: TransformPlan,
    done: TransformResult,
    target: Any,
    ckpt: Checkpoint,
    *,
    max_shard_size: str | int | None,
    verify: VerifyLevel,
    durable: bool,
    progress: Progress | None,
    force: bool,
) -> TransformResult:
    """Write the safetensors ``plan`` as shards in the folder ``target``.

    Args:
        done: the plan's dry-run result (its rows, sizes and notes), completed here.
        force: write into a non-empty ``target``, as ``merge_lora`` takes it.

    Returns:
        ``done`` with the files written (shards, then the index), or with each shard planned
        when it is a dry run.
    """
    check_verify_level(verify, why="merged bytes differ from the source's by design")
    limit = parse_shard_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    shards = plan_shards([(name, record.nbytes) for name, _, record in plan.entries], limit)
    by_name = {name: (t, record) for name, t, record in plan.entries}
    metadata = {k: v for k, v in (plan.metadata or {}).items() if k != "format"}
    if done.dry_run:  # the files the real run writes, its index too
        tensors = {name: t for name, (t, _) in by_name.items()}
        planned = planned_shard_files(plan.dst, tensors, shards, metadata)
        return replace(done, **dry_run_fields(plan.dst, planned), output_format="hf-sharded")

    def check(names: Sequence[str]) -> Check:
        expected = Expected({n: by_name[n][0] for n in names}, (), ckpt)

        def run(path: str) -> str:
            checked = verify_output(path, expected, "sizes" if verify == "full" else verify)
            written = [(n, by_name[n][1]) for n in names]
            return check_records(path, written) if verify == "full" else checked

        return run

    written = write_hf_shards(
        plan.entries,
        target,
        shards,
        check,
        metadata=metadata,
        counter=ByteCounter(progress, plan.output_bytes),
        durable=durable,
        replace=force,
    )
    return replace(
        done,
        dry_run=False,
        planned=(),
        written=tuple(os.path.join(plan.dst, name) for name in written),
        verification=f"verified ({verify})" if verify != "none" else NOT_VERIFIED,
        message=f"merge-lora: wrote {plan.dst} ({len(shards.files)} safetensors shard(s))",
        output_format="hf-sharded",
    )
