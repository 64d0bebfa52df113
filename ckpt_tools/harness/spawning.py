"""How the harness starts the processes of its ranks when no launcher (``torchrun``) did.

Starting torch costs seconds per process. Where the platform has ``forkserver``, its server
imports torch once and each rank is forked from it: a second run in the same process (a
parity run, a test session) starts its ranks without importing torch again. Like ``spawn``,
and unlike ``fork``, no rank inherits this process's state: no CUDA context, no threads.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping

from ckpt_tools.io.interrupts import signals_raise

__all__ = ["adopt_environment", "end_with_launcher", "free_port", "scratch_folder", "start_method"]

# Third-party modules only: a preloaded module stays as the server imported it, and this
# package may be imported from another path by the process that starts the ranks.
_PRELOAD = ["torch", "torch.distributed"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_method() -> str:
    """The start method for rank processes: ``forkserver`` (torch preloaded in its server)
    where the platform has it, else ``spawn``.

    It sets the process-wide preload list of ``multiprocessing``'s forkserver, which takes
    effect if the server has not started yet.

    Returns:
        The name to pass as ``start_method`` to ``torch.multiprocessing.start_processes``.

    Example:
        >>> start_method() in {"forkserver", "spawn"}
        True
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Read when the server starts: the first rank started by this process starts it.
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return "forkserver"


def adopt_environment(environ: Mapping[str, str]) -> None:
    """Give this rank the environment of the process that started it.

    A forked rank inherits the environment its server had when it started; a spawned one,
    its parent's at the time. Passing the parent's environment and adopting it keeps the
    two alike.

    Args:
        environ: the starting process's environment.

    Example:
        >>> before = dict(os.environ)
        >>> adopt_environment(before)
        >>> dict(os.environ) == before
        True
    """
    if dict(os.environ) != dict(environ):
        os.environ.clear()
        os.environ.update(environ)


def end_with_launcher(launcher: int) -> None:
    """End this rank (a SIGTERM to itself) once the ``launcher`` process ends, as
    ``torchrun``'s ranks end with it.

    Otherwise a launcher killed alone (a ``kill PID``, the OOM killer) leaves its ranks to
    finish and write the outputs of a run that was cancelled. Its death is not the parent's
    (a forked rank's parent is the forkserver, which the ranks themselves keep alive): a
    thread waits on the launcher's pidfd. Where there is none (not Linux), nothing is done.

    Args:
        launcher: the process id of the process that started the ranks.
    """
    try:
        pidfd = os.pidfd_open(launcher)
    except ProcessLookupError:  # it ended before this rank started
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError):
        return

    def wait() -> None:
        watch = select.poll()  # (select() refuses a descriptor past 1023)
        watch.register(pidfd, select.POLLIN)
        watch.poll()  # readable once the launcher has ended
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="ckpt-launcher-watch", daemon=True).start()


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[str]:
    """A temporary folder, removed however the run ends: SIGTERM and SIGHUP (a ``kill``, a
    cancelled CI job) unwind as Ctrl-C does, where their default action would end the
    process before any cleanup.

    Example:
        >>> import os
        >>> with scratch_folder("ckpt-doc-") as scratch:
        ...     made = os.path.isdir(scratch)
        >>> made, os.path.exists(scratch)
        (True, False)
    """
    with signals_raise() as release, tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        release()
        yield scratch
