"""``ckpt consolidate DCP_DIR OUT``: a DCP folder into one file or Hugging Face shards."""

from __future__ import annotations

from typing import Any

import click

from ckpt_tools.cli.options import (
    drop_extras_option,
    dry_run_option,
    durable_option,
    jobs_option,
    json_option,
    max_shard_size_option,
    select_option,
    verify_option,
)
from ckpt_tools.cli.writing import quiet_option, run_and_show
from ckpt_tools.ops.consolidate.consolidation import CONSOLIDATE_VERIFY_LEVELS, consolidate


@click.command("consolidate")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@select_option
@click.option(
    "--all",
    "everything",
    is_flag=True,
    help="Write everything saved (model, optimizer, other entries), nested as saved.",
)
@click.option("--strip", is_flag=True, help="Also remove wrapper prefixes (module., _orig_mod.).")
@click.option("--tag", help="DeepSpeed: the tag to read (default: the one 'latest' names).")
@click.option("--exclude-frozen", is_flag=True, help="DeepSpeed: leave the frozen parameters out.")
@max_shard_size_option(
    "Write OUT as a Hugging Face folder with shards up to SIZE (default 5GB when OUT is a folder)."
)
@jobs_option
@drop_extras_option
@click.option(
    "--force",
    is_flag=True,
    help="Replace OUT if it exists (never the input); a folder OUT keeps all but its weight "
    "files (model*.safetensors, pytorch_model*.bin and their index).",
)
@verify_option(
    "After writing, re-read every output: keys, dtypes, shapes, layout, or also every byte.",
    levels=CONSOLIDATE_VERIFY_LEVELS,
)
@durable_option
@quiet_option
@json_option
@dry_run_option
def consolidate_cmd(
    src: str, dst: str, as_json: bool, quiet: bool, everything: bool, **kw: Any
) -> None:
    """Consolidate a DCP folder or a DeepSpeed ZeRO checkpoint into OUT, torch-free.

    SRC is a torch.distributed.checkpoint (DCP) folder, or a DeepSpeed ZeRO checkpoint: its
    save folder (latest names the tag) or a tag folder.

    OUT is a .pt (torch.save format), a .safetensors, or a folder for Hugging Face shards
    (model-00001-of-0000N.safetensors + model.safetensors.index.json). Chunks are copied
    straight into place; memory does not grow with the checkpoint. A DeepSpeed checkpoint is
    written as DeepSpeed's get_fp32_state_dict_from_zero_checkpoint gives it: fp32 master
    weights, frozen ones in their trained dtype (the zero_to_fp32.py script casts those to
    fp32 too), float buffers in fp32.
    """
    run_and_show(consolidate, src, dst, include_all=everything, as_json=as_json, quiet=quiet, **kw)
