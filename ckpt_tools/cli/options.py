"""Options shared by several commands."""

from __future__ import annotations

import click

select_option = click.option(
    "--select",
    metavar="A.B",
    default=None,
    help="Dotted path to the state dict inside the checkpoint (default: chosen automatically).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
