"""The temp folder a folder output is written in: what it takes over from the folder it
replaces, and the threads that write its files, stopped as one.

Taken over, from a folder this process could write into
(:func:`~ckpt_tools.io.output_access.check_writable`, as ``cp -r`` needs): its group and setgid
bit while the temp folder is written (:func:`share_group`; it stays private and this
process's own until complete), then its owner and group where the process may set them, and
its permission bits (:func:`take_over`, just before the swap). A replaced file's mode and
owner go to the new file of that name, as :mod:`~ckpt_tools.io.atomic` keeps them for any
file (``write_file(like=)``).

Threads: Python runs signal handlers in the main thread only, and nothing outside a worker
thread can interrupt the write it is doing. So the main thread keeps the signal handling (the
folder writer holds :func:`~ckpt_tools.io.interrupts.signals_raise` around the whole write)
and waits for the workers in short steps, between which a handler can run. On any exception
there (:class:`~ckpt_tools.io.interrupts.Interrupted`, ``KeyboardInterrupt``) or in a worker,
a stop event is set: the files not started are cancelled, the running ones raise
:class:`Stopped` at their next piece (:class:`StopCounter`), each removing its own temp file,
and the exception goes up only once every worker has ended, so the caller's cleanup of the
temp folder never races a write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ckpt_tools.io.interrupts import signals_raise
from ckpt_tools.io.temp_names import fitted_name, is_temp_file, stands_for
from ckpt_tools.io.writers.progress import ByteCounter

__all__ = [
    "TEMP_FOLDER",
    "StopCounter",
    "Stopped",
    "exchange",
    "remove_temp_folder",
    "run_jobs",
    "share_group",
    "take_over",
    "temp_folder",
]

T = TypeVar("T")
R = TypeVar("R")

#: A run's temp folder (``.NAME.ckpt-tmpdir-PID-RANDOM``), or the replaced folder it moved
#: aside (the same name, then ``-old``): group 1 is the owner's PID.
TEMP_FOLDER = re.compile(r"^\..*\.ckpt-tmpdir-(\d+)-[0-9a-f]+(?:-old)?$")
_TEMP_MARK = ".ckpt-tmpdir-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2

# How long the main thread waits at a time: a signal delivered to a worker thread only marks
# the handler as due, and the main thread runs it once it is back in Python code.
_STEP = 0.05


def remove_temp_folder(entry: Path, kept: Callable[[str], bool] = lambda name: False) -> None:
    """Remove a killed run's temp folder; a symlink (left by older versions, which renamed a
    symlinked target aside) is unlinked, never followed.

    A replaced folder moved aside (``-old``) whose name is still free was the output when the
    run died between its two renames: it gets its name back instead. A temp folder may hold
    entries the run had moved out of the folder it was to replace (``kept`` tells their
    names): each that folder (named, or still aside) no longer has goes back into it first.
    Where the folder's name cannot be told (it was cut to fit, and is gone), a folder aside,
    or one holding such entries, is left where it is: it is the user's.
    """
    real = entry.is_dir() and not entry.is_symlink()
    stem, _, rest = entry.name[1:].rpartition(_TEMP_MARK)
    aside = rest.endswith("-old")
    name = stands_for(stem, _completion(rest.removesuffix("-old")), os.listdir(entry.parent))
    target = None if name is None else entry.parent / name
    if real and aside:
        if target is None:
            return
        if not os.path.lexists(target):
            os.rename(entry, target)
            return
    if real and not aside:
        # Killed between its two renames, the replaced folder is still aside: back there.
        home = target if target is not None and target.is_dir() else Path(f"{entry}-old")
        # Its own shards' temp files (named where O_TMPFILE is missing) are no user's entry.
        carried = [n for n in os.listdir(entry) if kept(n) and not is_temp_file(n)]
        if carried and not home.is_dir():
            return
        for child in carried:
            if not os.path.lexists(home / child):
                os.rename(entry / child, home / child)
    if real:
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink()


def temp_folder(target: Path, tag: str, *, aside: bool = False) -> Path:
    """The temp folder a run writes ``target`` in (``tag``: its PID and a random part), or
    with ``aside`` the name the folder it replaces is moved to; :data:`TEMP_FOLDER` matches
    both. A name too long to take them both within NAME_MAX is cut alike in both
    (:func:`~ckpt_tools.io.temp_names.fitted_name`)."""
    name = fitted_name(target.name, _completion(tag))
    return target.parent / f".{name}{_TEMP_MARK}{tag}{'-old' if aside else ''}"


def _completion(tag: str) -> str:
    """What a temp folder's name adds to the output's, at its longest."""
    return f".{_TEMP_MARK}{tag}-old"


def exchange(a: Path, b: Path) -> bool:
    """Swap the names of the folders ``a`` and ``b`` in one step (Linux's ``renameat2`` with
    ``RENAME_EXCHANGE``), so that no crash finds neither; False where the system or the
    file system cannot, and nothing was done.

    Raises:
        OSError: the swap itself failed (a name gone, no permission).
    """
    rename2 = getattr(_libc(), "renameat2", None)
    if rename2 is None:
        return False
    done = rename2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to ask (not a dynamically linked Python)
        return None


def share_group(tmp: Path, old: os.stat_result | None) -> None:
    """While it is written: give the temp folder the replaced folder's group and setgid bit
    (files made in it get the group they would get in that folder), where this process may,
    and keep it private (0o700) and this process's own."""
    if old is None:
        return
    with contextlib.suppress(OSError):  # not permitted, or an id this file system lacks
        os.chown(tmp, -1, old.st_gid)
    os.chmod(tmp, 0o700 | (old.st_mode & stat.S_ISGID))


def take_over(tmp: Path, old: os.stat_result | None) -> None:
    """Once it is complete: give the temp folder the replaced folder's owner and group where
    this process may (else its group alone, else neither), then its permission bits."""
    if old is None:
        return
    for uid in (old.st_uid, -1):
        try:
            os.chown(tmp, uid, old.st_gid)
            break
        except OSError:  # not permitted, or an id this file system lacks
            continue
    os.chmod(tmp, stat.S_IMODE(old.st_mode))


class Stopped(Exception):
    """A file abandoned because the folder write it belongs to is stopping."""


class StopCounter(ByteCounter):
    """A byte counter that raises :class:`Stopped` at the next piece once ``stop`` is set.

    Args:
        inner: the caller's counter, told every piece as before; None counts nothing.
        stop: the folder write's stop event.

    Example:
        >>> stop = threading.Event()
        >>> counter = StopCounter(None, stop)
        >>> counter(4)
        >>> stop.set()
        >>> counter(4)
        Traceback (most recent call last):
        ckpt_tools.io.writers.folder_temp.Stopped: the folder write is stopping
    """

    def __init__(self, inner: ByteCounter | None, stop: threading.Event) -> None:
        super().__init__(None, inner.total if inner is not None else 0)
        self._inner = inner
        self._stop = stop

    def __call__(self, nbytes: int) -> None:
        if self._stop.is_set():
            raise Stopped("the folder write is stopping")
        if self._inner is not None:
            self._inner(nbytes)


def run_jobs(
    work: Callable[[T], R], items: Sequence[T], jobs: int, stop: threading.Event
) -> tuple[R, ...]:
    """``work`` over ``items`` by ``jobs`` threads; the results in order.

    Args:
        work: writes one item; it checks ``stop`` (directly, or through a
            :class:`StopCounter`) and raises :class:`Stopped` once it is set.
        items: what to write.
        jobs: threads at most.
        stop: set on the first exception, here or in a worker.

    Raises:
        The first worker's exception, or what interrupted the wait (a signal's), once every
        worker has ended.

    Example:
        >>> run_jobs(str.upper, ["a", "b", "c"], 2, threading.Event())
        ('A', 'B', 'C')
    """
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait  # only here

    pool = ThreadPoolExecutor(max(1, min(jobs, len(items))))
    try:
        futures = [pool.submit(work, item) for item in items]
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=_STEP, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # a worker's error goes up at once
        return tuple(future.result() for future in futures)
    except BaseException:
        stop.set()
        raise
    finally:
        with signals_raise():  # a second signal is held until the workers have ended
            pool.shutdown(wait=True, cancel_futures=True)
