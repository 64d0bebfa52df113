"""The one boundary that turns the library's errors into a line and an exit code, click-free.

Both ways into ``ckpt`` pass through :func:`guarded`: click's (every command, through
:func:`ckpt_tools.cli.main.run_command`) and the key rewrites' fast path
(:mod:`ckpt_tools.cli.fastpath`), so an error prints the same line and ends with the same
code however the arguments were parsed. It and :func:`echo` import click only when the text
needs it: the fast path's point is a start without click.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from ckpt_tools.errors import CheckpointError
from ckpt_tools.io.atomic import Interrupted

__all__ = ["echo", "guarded"]


def echo(message: str, err: bool = False) -> None:
    """Print ``message`` and a newline on stdout (stderr with ``err``), as ``click.echo`` does.

    click strips ANSI escapes on a stream that is not a terminal, re-encodes a stream whose
    encoding it finds misconfigured (ASCII) and drives the Windows console; plain ASCII text
    without escapes comes out as the same bytes either way, so only other text (a key with
    an escape sequence in it, a non-ASCII name) is handed to click.

    Example:
        >>> echo("wrote out.pt")
        wrote out.pt
    """
    stream = sys.stderr if err else sys.stdout
    if stream is not None and sys.platform != "win32" and message.isascii():
        if "\x1b" not in message:
            stream.write(message + "\n")
            stream.flush()
            return
    import click

    click.echo(message, err=err)


def guarded(call: Callable[[], object], prog_name: str) -> int:
    """Run ``call``; a CheckpointError becomes one stderr line and its exit code.

    The line is the error rendered for the command line: its remedies name flags
    (``--force``), where ``str(error)`` names the library's arguments (``force=True``).
    ``CKPT_DEBUG=1`` lets the error through, with its traceback. A pipe that breaks on
    the way (stdout's reader gone, or stderr's while the error line is written) ends
    with exit 1 and nothing more said, as click's own ``main`` ends on one.

    Args:
        call: the command's work; it returns its exit code, or None for success.
        prog_name: the name error lines start with.

    Returns:
        The exit status: 0, the command's own code, or the error's exit code.

    Example:
        >>> from ckpt_tools.errors import UsageError
        >>> def fails() -> None:
        ...     raise UsageError("bad argument")
        >>> guarded(fails, "ckpt")  # prints "ckpt: error: bad argument" on stderr
        2
    """
    try:
        return _run(call, prog_name)
    except BrokenPipeError:
        # Never 0: a failed command whose stderr is gone has still failed. stdout now
        # points at /dev/null, so that the interpreter's last flush does not complain.
        # No stdout, one that is no file, or one already closed: nothing to silence.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stdout = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, stdout)
            finally:
                # A stdout whose descriptor was closed gets /dev/null as that very number:
                # closing it then would close stdout again.
                if devnull != stdout:
                    os.close(devnull)
        return 1


def _run(call: Callable[[], object], prog_name: str) -> int:
    try:
        code = call()
    except CheckpointError as e:
        if os.environ.get("CKPT_DEBUG") == "1":
            raise
        echo(f"{prog_name}: error: {e.render(for_cli=True)}", err=True)
        return e.exit_code
    except Interrupted as e:
        # SIGTERM/SIGHUP while writing: the temp file is already removed. One line, and
        # 128 + the signal number, as a shell reports such a kill.
        echo(f"{prog_name}: {e}; nothing was written and the input is unchanged", err=True)
        return 128 + e.signum
    # Commands return their exit code (``ckpt diff --fail-on``) or None for success.
    return code if isinstance(code, int) else 0
