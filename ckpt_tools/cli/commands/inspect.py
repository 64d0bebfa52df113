"""``ckpt inspect FILE``."""

from __future__ import annotations

import click

from ckpt_tools.cli.options import json_option, select_option
from ckpt_tools.cli.render import echo_json, echo_text, table
from ckpt_tools.ops.inspect.inspection import inspect


@click.command("inspect")
@click.argument("path", type=click.Path())
@select_option
@json_option
@click.option(
    "--group",
    is_flag=True,
    help="Fold the table's repeated layers: layers.{0..31}.fc.weight ×32.",
)
@click.option(
    "--limit", type=click.IntRange(min=0), default=None, help="Show at most this many table rows."
)
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="For a URL, also print on stderr the requests made and the bytes received.",
)
def inspect_cmd(
    path: str, select: str | None, as_json: bool, group: bool, limit: int | None, verbose: bool
) -> None:
    """Describe a checkpoint from its structure: never runs its pickle, never imports torch.

    PATH is a file, a folder, or a URL (https://, hf://ORG/REPO[@REV][/FILE], s3://BUCKET/KEY)
    of which only the structure is fetched, by byte ranges.
    """
    if as_json and (group or limit is not None):
        # The JSON lists every tensor, whatever shapes the table: said, not ignored.
        given = "--group" if group else "--limit"
        raise click.UsageError(f"{given} shapes the table; --json lists every tensor")
    info = inspect(path, select=select)
    if verbose and info.transfer is not None:
        echo_text(f"remote: {info.transfer}", err=True)
    if as_json:
        echo_json(info.to_json())
        return
    echo_text(info.text(group=group, limit=limit, table=table, for_cli=True))
