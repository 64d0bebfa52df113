"""Rendering results for people (tables) and for programs (``--json``).

The text itself comes from the results (``info.text()``, ``report.text()``, ``str(result)``),
the same text library users get; the command only picks the table function. What the command
prints for a person goes through :func:`echo_text` and :func:`table`, which escape what a
checkpoint's names could smuggle to the terminal (:func:`~ckpt_tools.structure.text.shown`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import click

from ckpt_tools.structure.text import counts, human_bytes, human_count, shown, text_table

__all__ = [
    "counts",
    "echo_json",
    "echo_result",
    "echo_text",
    "human_bytes",
    "human_count",
    "shown",
    "table",
]


def echo_json(data: Any) -> None:
    """Print ``data`` as indented, strict JSON on stdout.

    json.dumps escapes every control and every non-ASCII character (``ensure_ascii``), so
    JSON brings no escape sequence or bidi override to a terminal, and names stay exact.
    A number that is not finite is written as its name (``"inf"``, ``"nan"``).
    """
    import json  # only --json needs it; `ckpt` starts faster without

    from ckpt_tools.structure.json_values import json_ready

    text = json.dumps(json_ready(data), indent=2, sort_keys=False, default=str, allow_nan=False)
    click.echo(text)


def echo_text(text: str, err: bool = False) -> None:
    """Print text for a person, on stdout (or stderr), with names from files made safe.

    A name in a plain line cannot then move the cursor, clear the screen or reorder the text
    around it; table cells were escaped whole before their layout (:func:`table`).

    Args:
        text: lines for a person, ``\\n`` between them.
        err: print on stderr.

    Example:
        >>> echo_text("file: a\\x1b[2J.pt\\nkey: rtl\\u202eexe")
        file: a\\x1b[2J.pt
        key: rtl\\u202eexe
    """
    # Here, at the command's output, not in the results: their fields keep names as stored
    # for Python callers, and only the command writes to a terminal.
    click.echo(shown(text, lines=True), err=err)


def echo_result(result: Any, as_json: bool, quiet: bool = False) -> None:
    """Print a command's result: its ``text()``, or its ``to_json()`` (``--json``).

    ``quiet`` (``--quiet``) prints nothing: a script that only checks the exit code reads
    silence as success, and errors still print their line at the boundary. Output that was
    asked for by name still prints: ``--json``, and the plan of a ``--dry-run``.
    """
    if as_json:
        echo_json(result.to_json())
    elif not quiet or getattr(result, "dry_run", False):
        echo_text(result.text())


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table in tabulate's ``simple`` format (a :data:`TableFormat`).

    Text cells and headers are first :func:`~ckpt_tools.structure.text.shown`: one line
    each, a name's control and format characters escaped, whichever function lays them out.
    Where every cell and header is then one line of printable text, :func:`text_table` lays
    it out: tabulate's text, without importing tabulate, in a fraction of its time on a table
    of hundreds of rows, and aligned by display width (a wide CJK character takes two
    columns, a combining accent none), which tabulate does only with wcwidth installed.
    tabulate lays out the rest, whose layout it decides differently (None and bytes).
    """
    rows = [list(row) for row in rows]
    plain = _plain(rows, headers)
    if not plain:  # a plain table has nothing to escape
        rows = [[shown(c) if isinstance(c, str) else c for c in row] for row in rows]
        headers = [shown(h) for h in headers]
        plain = _plain(rows, headers)
    if plain:
        return text_table(rows, headers)
    from tabulate import tabulate  # imported on use: most tables never need it

    return tabulate(rows, headers=list(headers), tablefmt="simple", disable_numparse=True)


def _plain(rows: list[list[Any]], headers: Sequence[str]) -> bool:
    """Whether each row has a cell a header, and every cell is a line of printable text."""
    cells = [*headers, *(cell for row in rows for cell in row)]
    if {len(row) for row in rows} - {len(headers)} or {type(c) for c in cells} - {str}:
        return False
    return "".join(cells).isprintable()
