"""The one boundary that turns the library's errors into a line and an exit code.

Every ``ckpt`` command passes through :func:`guarded` (by
:func:`ckpt_tools.cli.main.run_command`), and so does ``python -m ckpt_tools.harness``: an
error prints the same line and ends with the same code whichever command met it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Callable

import click

__all__ = ["guarded"]


def guarded(call: Callable[[], object], prog_name: str) -> int:
    """Run ``call``; a CheckpointError becomes one stderr line and its exit code.

    The line is the error rendered for the command line: its remedies name flags
    (``--force``), where ``str(error)`` names the library's arguments (``force=True``).
    Any other error of the system (an input inside a folder that cannot be read, stdout on a
    full disk) is one line too: exit 6 where writing failed, else 2.
    ``CKPT_DEBUG=1`` prints the error's traceback first; the line and the exit code stay
    the same. An error of the program itself (a bug) is Python's traceback, exit 1. A pipe
    that breaks on the way (stdout's reader gone, or stderr's while the error line is
    written) ends with exit 1 and nothing more said, as click's own ``main`` ends on one:
    stdout, and a stderr whose pipe broke, then point at /dev/null, so exiting cannot fail
    again.

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
        # Never 0: a failed command whose stderr is gone has still failed.
        _silence(sys.stdout, always=True)
        _silence(sys.stderr, always=False)
        return 1


def _silence(stream: object, *, always: bool) -> None:
    """Point ``stream``'s descriptor at /dev/null, so the interpreter's last flush cannot fail.

    A buffered stream keeps what a broken pipe refused and offers it again at exit, where
    the failure turns the exit code into 120 (Python's advice for SIGPIPE: dup2 /dev/null
    over the descriptor). What a working stream holds is delivered first. ``always=False``
    leaves a stream whose flush succeeds as it is: its reader still hears what comes next.
    No stream, one that is no file, or one already closed: nothing to silence.
    """
    try:
        stream.flush()  # type: ignore[attr-defined]
        broken = False
    except (AttributeError, OSError, ValueError):
        broken = True
    if not (always or broken):
        return
    with contextlib.suppress(AttributeError, OSError, ValueError):
        fd = stream.fileno()  # type: ignore[attr-defined]
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            # A stream whose descriptor was closed gets /dev/null as that very number:
            # closing it then would close the stream again.
            if devnull != fd:
                os.close(devnull)


# The system's errors that mean the output (a file, or stdout) could not be written.
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _say(line: str) -> None:
    """Write the error line on stderr, every control character and line break escaped.

    The last guard: a message that quotes a key from the file (``"epoch\\nckpt: ok"``)
    stays one line, so no file can print a line of its own under ``ckpt``'s name.
    """
    from ckpt_tools._escape import shown

    click.echo(shown(line), err=True)


def _os_error(e: OSError, prog_name: str) -> int:
    """One line for an error of the system the library did not expect (an input a folder
    holds that cannot be read, stdout on a full disk): 6 where writing failed, else 2."""
    where = f": {os.fsdecode(e.filename)!r}" if e.filename is not None else ""
    if e.errno in _OUTPUT_ERRNOS:
        _silence(sys.stdout, always=False)  # what stdout refused is not offered again at exit
        _say(f"{prog_name}: error: writing failed ({e.strerror or e}){where}")
        return 6
    _say(f"{prog_name}: error: {e.strerror or e}{where}")
    return 2


def _run(call: Callable[[], object], prog_name: str) -> int:
    try:
        code = call()
    except BaseException as e:
        # Imported once something was raised: `ckpt --version` and `ckpt --help` start
        # without the error tree and the write machinery.
        from ckpt_tools.errors import CheckpointError
        from ckpt_tools.io.interrupts import Interrupted

        unexpected = isinstance(e, OSError) and not isinstance(
            e, (CheckpointError, BrokenPipeError)
        )
        if not (unexpected or isinstance(e, (CheckpointError, Interrupted))):
            raise  # a bug, KeyboardInterrupt, a broken pipe: Python's own report
        if os.environ.get("CKPT_DEBUG") == "1":
            # The traceback first, then the line and the exit code a script relies on.
            traceback.print_exception(e, file=sys.stderr)
        if isinstance(e, CheckpointError):
            # What stdout refused (a full disk under the summary) is not offered again at exit.
            _silence(sys.stdout, always=False)
            # A message may quote a key from the file: one line, whatever the key holds.
            _say(f"{prog_name}: error: {e.render(for_cli=True)}")
            return e.exit_code
        if unexpected:
            return _os_error(e, prog_name)  # type: ignore[arg-type]
        if isinstance(e, Interrupted):
            # SIGTERM/SIGHUP while writing: the temp file is already removed, or the output
            # had just been named. One line, and 128 + the signal number, as a shell reports
            # such a kill.
            if e.written is None:
                done = "nothing was written and the input is unchanged"
            else:
                done = f"{e.written!r} had been written and is complete"
            _say(f"{prog_name}: {e}; {done}")
            return 128 + e.signum
        raise
    # Commands return their exit code (``ckpt diff --fail-on``) or None for success.
    return code if isinstance(code, int) else 0
