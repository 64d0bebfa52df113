"""``ckpt sanitize IN OUT``."""

from __future__ import annotations

import click

from ckpt_tools.cli.options import (
    dry_run_option,
    durable_option,
    json_option,
    select_option,
    verify_option,
)
from ckpt_tools.cli.writing import quiet_option, run_and_show
from ckpt_tools.ops.sanitize.sanitizing import sanitize


@click.command("sanitize")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@select_option
@click.option("--strict", is_flag=True, help="Refuse (exit 3) instead of dropping values.")
@click.option("--force", is_flag=True, help="Replace DST if it exists (never the input).")
@verify_option("After writing, re-read the output: keys and sizes, or also every byte.")
@durable_option
@quiet_option
@json_option
@dry_run_option
def sanitize_cmd(
    src: str,
    dst: str,
    select: str | None,
    strict: bool,
    force: bool,
    verify: str,
    durable: bool,
    quiet: bool,
    as_json: bool,
    dry_run: bool,
) -> None:
    """Write SRC as DST that plain torch.load(weights_only=True) loads.

    Nothing in SRC is imported or run. numpy arrays become tensors, numpy scalars numbers,
    argparse/OmegaConf configs, defaultdicts, dict subclasses, paths and enums plain
    values, pickled nn.Modules their state dict; anything else is dropped and listed
    (--strict: refused).
    """
    run_and_show(
        sanitize,
        src,
        dst,
        as_json=as_json,
        quiet=quiet,
        refuse_unsafe=strict,
        select=select,
        force=force,
        verify=verify,
        dry_run=dry_run,
        durable=durable,
    )
