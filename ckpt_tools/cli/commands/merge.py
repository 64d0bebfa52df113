"""``ckpt merge-lora``: one library call, then render."""

from __future__ import annotations

from typing import Any

import click

from ckpt_tools.cli.options import (
    allow_global_option,
    cast_dtype_option,
    drop_extras_option,
    dry_run_option,
    durable_option,
    json_option,
    max_shard_size_option,
    output_format_option,
    select_option,
    verify_option,
)
from ckpt_tools.cli.writing import quiet_option, run_and_show


@click.command("merge-lora")
@click.argument("base", type=click.Path())
@click.argument("adapter", type=click.Path())
@click.argument("out", type=click.Path())
@cast_dtype_option("the merged state dict's")
@select_option
@output_format_option("OUT")
@drop_extras_option
@max_shard_size_option(
    "Write OUT as a Hugging Face folder with shards up to SIZE (default 5GB when OUT ends "
    "with / or is a folder)."
)
@click.option(
    "--fan-in-fan-out/--no-fan-in-fan-out",
    default=None,
    help="Square target weights that neither their shape nor BASE's config.json settles are "
    "GPT-2 Conv1D (or, with --no-fan-in-fan-out, Linear).",
)
@click.option("--force", is_flag=True, help="Replace OUT if it exists (never an input).")
@verify_option("After writing, re-read keys and sizes, or also every byte (computed again).")
@durable_option
@allow_global_option
@quiet_option
@json_option
@dry_run_option
def merge_lora_cmd(
    base: str, adapter: str, out: str, as_json: bool, quiet: bool, **kw: Any
) -> None:
    """Merge a PEFT LoRA adapter folder into its base checkpoint, as PEFT merges, torch-free.

    BASE: a .pt, .safetensors or Hugging Face folder. ADAPTER: the folder PEFT saved
    (adapter_config.json and adapter_model.safetensors or .bin). OUT: a file (.pt or
    .safetensors), or a Hugging Face folder when it ends with / or --max-shard-size is given.
    """
    from ckpt_tools.ops.merge.merging import merge_lora

    run_and_show(merge_lora, base, adapter, out, as_json=as_json, quiet=quiet, **kw)
