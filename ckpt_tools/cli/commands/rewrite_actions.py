"""What the rewrite commands do once their arguments are parsed: click-free.

click's commands in :mod:`ckpt_tools.cli.commands.rewrite` and the fast path of
:mod:`ckpt_tools.cli.fastpath` both call these, so a key rewrite does the same work and
prints the same text whichever parsed its command line. click is imported only to draw a
progress bar on a terminal.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ckpt_tools.cli.boundary import echo

__all__ = ["add_module", "library_options", "progress_bar", "report", "strip_module"]

# The progress bar is drawn only for rewrites worth watching.
_BAR_BYTES = 64 << 20


@contextlib.contextmanager
def progress_bar(quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback that draws a bar on a terminal (stderr), or None.

    Args:
        quiet: the command's ``--quiet``: no bar.

    Yields:
        ``progress(done, total)`` for the library call, or None when no bar is wanted
        (quiet, stderr not a terminal); the bar appears once ``total`` reaches 64 MiB.
    """
    # A bar only for people watching a terminal, and only for rewrites worth watching.
    if quiet or not sys.stderr.isatty():
        yield None
        return
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if total < _BAR_BYTES:
            return
        bar = state.get("bar")
        if bar is None:
            import click

            bar = state["bar"] = click.progressbar(
                length=total, label="copying tensors", file=sys.stderr, show_pos=False
            )
            bar.__enter__()
            state["done"] = 0
        bar.update(done - state["done"])
        state["done"] = done

    try:
        yield update
    finally:
        if "bar" in state:
            state["bar"].__exit__(None, None, None)


def report(result: Any, as_json: bool) -> None:
    """Print a rewrite's result: its text, or its JSON (``--json``)."""
    if as_json:
        from ckpt_tools.cli.render import echo_json

        echo_json(result.to_json())
    else:
        echo(result.text())


def library_options(
    kw: dict[str, Any], progress: Callable[[int, int], None] | None
) -> dict[str, Any]:
    """The library's keyword arguments for the options every rewrite command takes."""
    return {
        "select": kw["select"],
        "force": kw["force"],
        "in_place": kw["in_place"],
        "verify": kw["verify"],
        "allow_globals": kw["allow_globals"],
        "progress": progress,
        "dry_run": kw["dry_run"],
        "durable": kw["durable"],
    }


def strip_module(src: str, dst: str, prefix: str | None, **kw: Any) -> None:
    """``ckpt strip-module``: :func:`~ckpt_tools.strip_module_file`, reported."""
    from ckpt_tools.ops.rewrite.rewriting import strip_module_file

    with progress_bar(kw["quiet"]) as progress:
        result = strip_module_file(src, dst, prefix=prefix, **library_options(kw, progress))
    report(result, kw["as_json"])


def add_module(src: str, dst: str, prefix: str, **kw: Any) -> None:
    """``ckpt add-module``: :func:`~ckpt_tools.ops.rewrite.rewriting.add_module_file`, reported."""
    from ckpt_tools.ops.rewrite.rewriting import add_module_file

    with progress_bar(kw["quiet"]) as progress:
        result = add_module_file(src, dst, prefix=prefix, **library_options(kw, progress))
    report(result, kw["as_json"])
