"""Atomic output files: a temp file in the target folder, fsync, rename, directory fsync.

Whatever goes wrong (an exception, disk full, SIGTERM/SIGHUP/SIGINT), the temp file is
removed and the target is either untouched or complete. Only SIGKILL can leave a temp file
behind; such files are named ``.NAME.*.ckpt-tmp`` so they are easy to find.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from ckpt_tools.errors import OutputError, OutputExistsError, SameFileError

__all__ = ["TEMP_SUFFIX", "Interrupted", "atomic_output", "check_output_path"]

TEMP_SUFFIX = ".ckpt-tmp"


class Interrupted(BaseException):
    """A signal arrived while an output was being written (the temp file is removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signal.Signals(signum).name}")
        self.signum = signum


def _same_file(a: Path, b: Path) -> bool:
    # samefile compares device and inode: it sees hard links and symlinks alike.
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output_path(
    dst: str | os.PathLike[str],
    src: str | os.PathLike[str] | None = None,
    force: bool = False,
    in_place: bool = False,
) -> Path:
    """Refuse outputs that would clobber something, before any work is done.

    Args:
        dst: the output path.
        src: the input path, if any, to refuse writing over it.
        force: allow replacing an existing ``dst`` (never the input).
        in_place: allow ``dst`` to be ``src`` (still written through a temp file and rename).

    Returns:
        The output path, with a symlink at ``dst`` resolved (the link is kept, its target
        replaced).

    Raises:
        SameFileError: ``dst`` is ``src`` and ``in_place`` is False.
        OutputExistsError: ``dst`` exists and ``force`` is False.
        OutputError: ``dst``'s folder does not exist or is a file.
    """
    out = Path(dst)
    if src is not None and out.exists() and _same_file(Path(src), out):
        if not in_place:
            raise SameFileError(dst)
        return out.resolve()
    if out.is_dir():
        raise OutputError(f"output {str(dst)!r} is a folder; give a file path", path=dst)
    if out.exists() and not force:
        raise OutputExistsError(dst)
    folder = out.resolve().parent
    if not folder.is_dir():
        raise OutputError(
            f"the output folder {str(folder)!r} does not exist; create it first", path=dst
        )
    return out.resolve() if out.is_symlink() else out


_RAISED = (signal.SIGTERM, signal.SIGHUP)
_HELD = (*_RAISED, signal.SIGINT)


@contextlib.contextmanager
def _signals_raise() -> Iterator[Callable[[], None]]:
    """Inside, SIGTERM and SIGHUP raise :class:`Interrupted`.

    Until the yielded ``release`` is called, they and SIGINT are only noted, then raised
    again by ``release``: a temp file is created and its cleanup armed before any of them
    can interrupt. (Blocking them with ``pthread_sigmask`` would not do: the kernel hands a
    process-wide signal to any thread that does not block it, torch's among them.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    pending: list[int] = []

    def hold(signum: int, frame: object) -> None:
        pending.append(signum)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, hold) for signum in _HELD}
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        for signum in _HELD:
            old = previous[signum]
            # An ignored signal stays ignored (`nohup ckpt ...` must survive its SIGHUP).
            handler = interrupt if signum in _RAISED and old is not signal.SIG_IGN else old
            if handler is not None:
                signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)  # its handler runs now, in the caller's cleanup

    try:
        yield release
    finally:
        try:
            release()
        finally:
            for signum in _RAISED:
                if previous[signum] is not None:
                    signal.signal(signum, previous[signum])


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some file systems cannot open folders; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(dst: str | os.PathLike[str]) -> Iterator[tuple[BinaryIO, Path]]:
    """Write ``dst`` atomically.

    Yields ``(file, temp_path)``; the body writes through ``file`` (and may re-open
    ``temp_path`` to verify it). On a clean exit the file is fsynced, renamed over ``dst``,
    and the folder fsynced. On any exception or SIGTERM/SIGHUP the temp file is removed.

    Call :func:`check_output_path` first: this function replaces ``dst`` unconditionally.

    Raises:
        OutputError: the temp file cannot be created or written (disk full, permissions).

    Example:
        >>> with atomic_output("out.pt") as (f, tmp):  # doctest: +SKIP
        ...     f.write(b"...")
    """
    target = Path(dst)
    folder = target.resolve().parent
    with _signals_raise() as release:
        try:
            fd, tmp_name = tempfile.mkstemp(
                prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=folder
            )
        except OSError as e:
            raise OutputError(
                f"cannot create a temp file in {str(folder)!r}: {e.strerror}", path=dst
            ) from e
        tmp = Path(tmp_name)
        f = os.fdopen(fd, "w+b")
        try:
            release()  # a signal noted since before the temp file existed is raised here
            with f:
                yield f, tmp
                f.flush()
                os.fsync(f.fileno())
            if target.exists():
                # Keep the replaced file's permission bits, as editors do.
                os.chmod(tmp, target.stat().st_mode & 0o7777)
            else:
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, target)
        except OSError as e:
            f.close()
            tmp.unlink(missing_ok=True)
            if isinstance(e, OutputError):
                raise
            raise OutputError(
                f"writing {str(dst)!r} failed ({e.strerror or e}); nothing was written and the "
                "input is unchanged",
                path=dst,
            ) from e
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
    _fsync_dir(folder)
