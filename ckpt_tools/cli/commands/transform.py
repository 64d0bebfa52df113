"""``ckpt slim``, ``ckpt extract``, ``ckpt average``: one library call each, then render."""

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
    option_group,
    output_format_option,
    select_option,
    verify_option,
)
from ckpt_tools.cli.writing import quiet_option, run_and_show

#: Options every transform takes (the output side).
_writing = option_group(
    select_option,
    output_format_option("DST"),
    drop_extras_option,
    click.option("--force", is_flag=True, help="Replace DST if it exists (never an input)."),
    verify_option("After writing, re-read keys and sizes, or also every byte (computed again)."),
    durable_option,
    allow_global_option,
    json_option,
    dry_run_option,
)


@click.command("slim")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@cast_dtype_option("the state dict's")
@click.option(
    "--keep-dtype",
    multiple=True,
    metavar="REGEX",
    help="Keys matching keep their dtype (repeatable).",
)
@click.option(
    "--drop",
    multiple=True,
    metavar="A,B",
    help="Top-level entries to leave out (optimizer,scheduler).",
)
@click.option(
    "--weights-only",
    is_flag=True,
    help="Write the selected state dict alone, as a plain state dict.",
)
@click.option(
    "--ema",
    is_flag=True,
    help="Select the EMA copy (state_dict_ema, model_ema, ema, Lightning EMA, Ultralytics' "
    "pickled ema module: its state dict).",
)
@quiet_option
@_writing
def slim_cmd(src: str, dst: str, as_json: bool, quiet: bool, **kw: Any) -> None:
    """Make a checkpoint smaller: cast, drop entries, keep the (EMA) weights only."""
    from ckpt_tools.ops.transform.slim import slim

    run_and_show(slim, src, dst, as_json=as_json, quiet=quiet, **kw)


@click.command("extract")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option(
    "--prefix",
    required=True,
    help="Keep the keys under this module path: layer1 keeps layer1 and layer1.*, not layer10.*.",
)
@click.option(
    "--strip-prefix",
    is_flag=True,
    help="Remove the prefix and its dot from the kept keys (a key it would empty is refused).",
)
@click.option("--ema", is_flag=True, help="Take the EMA copy (as slim --ema).")
@quiet_option
@_writing
def extract_cmd(src: str, dst: str, as_json: bool, quiet: bool, **kw: Any) -> None:
    """The tensors under one prefix, as a plain state dict."""
    from ckpt_tools.ops.transform.extract import extract

    run_and_show(extract, src, dst, as_json=as_json, quiet=quiet, **kw)


def _weights(value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(w) for w in value.split(",")]
    except ValueError as e:
        raise click.BadParameter(
            f"{value!r}: expected numbers, e.g. 1,1,2", param_hint="'--weights'"
        ) from e


@click.command("average")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.argument("dst", type=click.Path())
@click.option("--weights", default=None, metavar="W1,W2,...", help="One weight per input.")
@click.option(
    "--ints",
    type=click.Choice(["first", "last"]),
    default=None,
    help="Take integer tensors and non-tensor entries from this input instead of requiring "
    "them equal.",
)
@click.option(
    "--last",
    type=int,
    default=None,
    metavar="N",
    help="Of the inputs (globs expanded), the last N by the numbers in their paths (where "
    "nothing else in them differs), else by mtime.",
)
@quiet_option
@_writing
def average_cmd(
    inputs: tuple[str, ...],
    dst: str,
    weights: str | None,
    last: int | None,
    as_json: bool,
    quiet: bool,
    **kw: Any,
) -> None:
    """Element-wise (weighted) mean of checkpoints, streamed in float64.

    The INPUTs (globs expanded) are averaged into DST, the last argument, as cp takes it.
    """
    from ckpt_tools.ops.average.averaging import average, pick_inputs

    picked = pick_inputs(list(inputs), last)
    run_and_show(
        average, picked, dst, weights=_weights(weights), as_json=as_json, quiet=quiet, **kw
    )
