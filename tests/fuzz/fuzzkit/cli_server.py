"""The ``ckpt`` command for the fuzzer: one process per command, forked from this server.

Most of a small input's ``python -m ckpt_tools`` is spent starting Python and importing the
command line. This server imports what ``python -m ckpt_tools`` imports before it reads its
arguments, once, then forks a child per request. From the fork on, the child is the fresh
process: its own session (a kill reaches its children), the server's memory and file-size
bounds, the request's working folder, environment and arguments, stdin from ``/dev/null``,
stdout and stderr into files; ``ckpt_tools/__main__.py`` runs as ``python -m`` runs it, and
the child exits as the interpreter would (a traceback and 1 for an uncaught exception, 120 when
stdout cannot be flushed, after threads and ``atexit`` handlers).

Run as a script by :class:`fuzzkit.workers.CliServer`; one JSON line each way: a request
``{"argv", "cwd", "env", "stdout", "stderr"}`` (and ``"module"``, ``ckpt_tools`` unless
given: the tests of this server run modules of their own) is answered ``{"pid": N}`` at once and
``{"status": <wait status>}`` when the child has ended.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import signal
import sys
import threading
import traceback
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>; fork clears it, so each child sets it again
_FLUSH_FAILED = 120  # the interpreter's status when flushing stdout at exit fails


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` ends the interpreter with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_main(module: str) -> int:
    try:
        runpy._run_module_as_main(module)  # what python -m calls
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        # The interpreter's report, from python -m's frames on (not this function's).
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        code = 1
    shutdown = getattr(threading, "_shutdown", None)  # joins non-daemon threads, as at exit
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        code = code or _FLUSH_FAILED
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    return code


def _child(request: dict[str, Any], channel: int) -> None:
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.close(channel)  # the server's answers are not the command's to write
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.argv = ["-m", *request["argv"]]  # python -m puts __main__.py's path first
    sys.path[0] = os.getcwd()  # where python -m looks first
    os._exit(_run_main(request.get("module", "ckpt_tools")))


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print in the server cannot break an answer
    import ckpt_tools.cli.main  # noqa: F401  (what python -m ckpt_tools imports first)

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(request, answers.fileno())
            finally:
                os._exit(70)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": status}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
