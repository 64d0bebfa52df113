"""Rendering results for people (tables) and for programs (``--json``).

The text itself comes from the results (``info.text()``, ``report.text()``, ``str(result)``),
the same text library users get; the command only picks the table function.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import click

from ckpt_tools.structure.text import counts, human_bytes, human_count, text_table

__all__ = ["counts", "echo_json", "echo_result", "human_bytes", "human_count", "table"]


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    import json  # only --json needs it; `ckpt` starts faster without

    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def echo_result(result: Any, as_json: bool, quiet: bool = False) -> None:
    """Print a command's result: its ``text()``, or its ``to_json()`` (``--json``).

    ``quiet`` (``--quiet``) prints nothing: a script that only checks the exit code reads
    silence as success, and errors still print their line at the boundary. Output that was
    asked for by name still prints: ``--json``, and the plan of a ``--dry-run``.
    """
    if as_json:
        echo_json(result.to_json())
    elif not quiet or getattr(result, "dry_run", False):
        click.echo(result.text())


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table in tabulate's ``simple`` format (a :data:`TableFormat`).

    Where every cell and header is one line of printable ASCII, :func:`text_table` lays it
    out: the same text, without importing tabulate, in a fraction of its time on a table of
    hundreds of rows. tabulate lays out the rest, whose layout it decides differently (line
    breaks, escape sequences, wide characters, None and bytes).
    """
    rows = [list(row) for row in rows]
    if _plain(rows, headers):
        return text_table(rows, headers)
    from tabulate import tabulate  # imported on use: most tables never need it

    return tabulate(rows, headers=list(headers), tablefmt="simple", disable_numparse=True)


def _plain(rows: list[list[Any]], headers: Sequence[str]) -> bool:
    """Whether each row has a cell a header, and every cell is a line of printable ASCII."""
    cells = [*headers, *(cell for row in rows for cell in row)]
    if {len(row) for row in rows} - {len(headers)} or {type(c) for c in cells} - {str}:
        return False
    text = "".join(cells)
    return text.isascii() and text.isprintable()
