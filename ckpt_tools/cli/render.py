"""Rendering results for people (tabulate) and for programs (``--json``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import click

__all__ = ["echo_json", "human_bytes", "human_count", "table"]


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain-text table."""
    from tabulate import tabulate  # imported on use: `--json` output does not need it

    return tabulate(list(rows), headers=list(headers), tablefmt="simple", disable_numparse=True)


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    """``11689512`` -> ``11.69M``."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def counts(mapping: dict[str, int]) -> str:
    """``{"float32": 3, "int64": 1}`` -> ``float32 ×3, int64 ×1``."""
    return ", ".join(f"{k} ×{v}" for k, v in mapping.items()) or "none"
