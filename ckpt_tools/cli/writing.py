"""What every writing command shares: ``--quiet``, the progress bar, and running the call.

A writing command parses its options, then :func:`run_and_show` calls the library with a
progress callback (a bar on a terminal, for outputs worth watching; none with ``--quiet`` or
``--json``) and renders the result.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from ckpt_tools.cli.render import echo_result

__all__ = ["progress_bar", "quiet_option", "run_and_show"]

# The progress bar is drawn only for outputs worth watching.
_BAR_BYTES = 64 << 20


def _hush_warnings(ctx: click.Context, _param: click.Parameter, quiet: bool) -> bool:
    """Under ``--quiet``, the library's warnings (logged, as a folder's unread files) are
    not printed either, for this command only; ``logging`` is imported only then."""
    if quiet:
        import logging

        logger = logging.getLogger("ckpt_tools")
        level = logger.level
        logger.setLevel(logging.ERROR)
        ctx.call_on_close(lambda: logger.setLevel(level))
    return quiet


#: ``--quiet``/``-q`` of every writing command: no progress bar, no summary, no warning.
quiet_option = click.option(
    "--quiet",
    "-q",
    is_flag=True,
    callback=_hush_warnings,
    help="Print nothing on success: no progress bar, no summary.",
)


@contextlib.contextmanager
def progress_bar(quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback that draws a bar on a terminal (stderr), or None.

    Args:
        quiet: no bar (the command's ``--quiet``, or ``--json``).

    Yields:
        ``progress(done, total)`` for the library call, or None when no bar is wanted
        (quiet, stderr not a terminal); the bar appears once ``total`` reaches 64 MiB.
    """
    if quiet or not sys.stderr.isatty():
        yield None
        return
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if total < _BAR_BYTES:
            return
        bar = state.get("bar")
        if bar is None:
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


def run_and_show(
    call: Callable[..., Any], *args: Any, as_json: bool, quiet: bool, **kw: Any
) -> None:
    """``call(*args, progress=..., **kw)`` with a progress bar (unless quiet or JSON), then
    its result rendered (:func:`~ckpt_tools.cli.render.echo_result`)."""
    with progress_bar(quiet or as_json) as progress:
        result = call(*args, progress=progress, **kw)
    try:
        echo_result(result, as_json, quiet)
    except BrokenPipeError:
        raise  # a reader that left: the boundary's own quiet exit
    except OSError as e:  # stdout on a full disk: say what was written, not that it failed
        from ckpt_tools.errors import OutputError

        written = getattr(result, "written", ()) or ()
        names = ", ".join(repr(w) for w in written)
        done = f"; {names} {'was' if len(written) == 1 else 'were'} written" if written else ""
        raise OutputError(f"printing the summary to stdout failed ({e.strerror or e}){done}") from e
