"""Atomic output files: a temp file in the target folder, fsync, rename, directory fsync.

Whatever goes wrong (an exception, disk full, SIGTERM/SIGHUP/SIGINT), the temp file is
removed and the target is either untouched or complete.

Even SIGKILL leaves nothing behind where the file system has unnamed temp files
(``O_TMPFILE``: ext4, xfs, btrfs, tmpfs): the output is written to a file with no name,
which the kernel frees if the process dies, and it gets a name only once it is complete
and verified (``linkat`` through ``/proc/self/fd``, then ``rename`` over the target).
Elsewhere the temp file is named ``.NAME.ckpt-tmp-PID-RANDOM``; a SIGKILL can leave it
behind, and the next :func:`atomic_output` in that folder removes every such file whose
owner PID is no longer running on this machine.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ckpt_tools.errors import CheckpointError, OutputError, OutputExistsError
from ckpt_tools.io.interrupts import naming, signals_raise
from ckpt_tools.io.temp_names import remove_stale_temps, temp_name

__all__ = ["PAUSE_ENV", "AtomicFile", "atomic_output", "fsync_folder"]

#: Tests only: seconds to sleep once the output is written, before it is named, so a test
#: can SIGKILL a real ``ckpt`` at that point. Unset in normal use.
PAUSE_ENV = "CKPT_TOOLS_TEST_PAUSE_BEFORE_RENAME"
_UMASK_LOCK = threading.Lock()


@dataclass(frozen=True)
class AtomicFile:
    """The output :func:`atomic_output` is writing: what a writer needs to fill it.

    Attributes:
        file: the temp file, opened ``w+b``.
        path: a path that re-opens it (to verify it); ``/proc/self/fd/N`` for an unnamed one.
        durable: whether it will be fsynced before it is named. Writers pass it on to the
            copy engine: bytes that must reach the disk anyway are written so that they
            do, and bytes that need not are left to the page cache.
    """

    file: BinaryIO
    path: Path
    durable: bool


def keep_mode_and_owner(fd: int, target: Path) -> None:
    """The replaced file's permission bits (as editors keep them) and, where this process may
    set them, its owner and group (root replacing a user's file); else 0o666 less umask."""
    try:
        st = target.stat()
    except FileNotFoundError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):  # nothing, or no file to take bits from
        os.fchmod(fd, 0o666 & ~_umask())
        return
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):  # chown first: it clears set-id bits
            os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, st.st_mode & 0o7777)


def _umask() -> int:
    """The process's umask, read without changing it: setting it to read it back, as
    ``os.umask`` must, would hand a moment's other umask to the files other threads (the
    shards of a folder written by several) create meanwhile."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:  # no /proc (or no Umask line before Linux 4.7): one thread at a time
        umask = os.umask(0o077)
        os.umask(umask)
    return umask


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """fsync a folder, so that the names just made or renamed in it survive a power loss.

    Args:
        folder: the folder; one its file system cannot open or fsync is passed over.

    Example:
        >>> import tempfile
        >>> fsync_folder(tempfile.mkdtemp())
    """
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


def _can_link_fds() -> bool:
    """Whether an unnamed file can be given a name: Linux ``linkat`` through /proc/self/fd."""
    return (
        sys.platform.startswith("linux")
        and os.link in os.supports_dir_fd
        and os.path.isdir("/proc/self/fd")
    )


def _link_fd(fd: int, name: Path) -> None:
    """Give the unnamed file open as ``fd`` the name ``name``.

    ``linkat(/proc/self/fd, "N", ..., AT_SYMLINK_FOLLOW)``: os.link calls ``linkat`` (not
    ``link``, which cannot follow /proc/self/fd) once it is given a source folder.
    """
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _open_temp(target: Path, unnamed: bool) -> tuple[int, Path, bool]:
    """An open temp file in ``target``'s folder: ``(fd, path to re-open it, unnamed)``."""
    folder = target.parent
    if unnamed and hasattr(os, "O_TMPFILE") and _can_link_fds():
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
        except OSError as e:
            # EOPNOTSUPP/EISDIR/EINVAL: this file system has no unnamed files; fall back.
            if e.errno not in (95, 21, 22):
                raise
        else:
            return fd, Path(f"/proc/self/fd/{fd}"), True
    tmp = temp_name(target)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    return fd, tmp, False


def _name_it(fd: int, tmp: Path, unnamed: bool, target: Path, replace: bool) -> None:
    """Give the finished temp file ``target``'s name: replacing it atomically, or (``replace``
    False: it did not exist when the write began) only if it still does not exist."""
    if not replace:
        _name_new(fd, tmp, unnamed, target)
        return
    if unnamed:
        # A name of its own first (linkat cannot replace), then the atomic rename; only a
        # SIGKILL between the two leaves a named temp, which remove_stale_temps handles.
        named = temp_name(target)
        _link_fd(fd, named)
        tmp = named
    try:
        os.replace(tmp, target)
    except BaseException:  # a failed rename, or a signal between the link and the rename
        tmp.unlink(missing_ok=True)
        raise


def _name_new(fd: int, tmp: Path, unnamed: bool, target: Path) -> None:
    """Name the temp file ``target`` unless something took that name while it was written
    (another process, another ``ckpt``): a link fails where a rename would replace it."""
    try:
        if unnamed:
            _link_fd(fd, target)
        else:
            os.link(tmp, target)
            tmp.unlink()
    except FileExistsError as e:
        raise OutputExistsError(target) from e
    except OSError:
        if unnamed:
            raise
        if target.exists():  # a file system without hard links: the narrow check, then rename
            raise OutputExistsError(target) from None
        os.replace(tmp, target)


def _test_pause() -> None:
    seconds = os.environ.get(PAUSE_ENV)
    if seconds:
        time.sleep(float(seconds))


@contextlib.contextmanager
def atomic_output(
    dst: str | os.PathLike[str],
    *,
    replace: bool = False,
    unnamed: bool = True,
    durable: bool = True,
    like: Path | None = None,
) -> Iterator[AtomicFile]:
    """Write ``dst`` atomically.

    Yields an :class:`AtomicFile`; the body writes through its ``file`` (and may re-open
    its ``path`` to verify it), and passes its ``durable`` to the writers. On a clean exit
    the file is fsynced, named ``dst`` (replacing it), and the folder fsynced.
    On any exception or SIGTERM/SIGHUP the temp file is removed (one that lands as it is
    named is raised once it has the name, as ``Interrupted(written=dst)``); on SIGKILL an
    unnamed one vanishes with the process, and a named one is removed by the next run in
    that folder (:func:`remove_stale_temps`).

    Args:
        dst: the output path.
        replace: the caller accepted replacing ``dst`` (``force``, in place). False: a
            ``dst`` that exists when the write starts, or appears while it runs, is
            refused, so one that appeared after :func:`check_output_path` is never lost.
        unnamed: use an unnamed (``O_TMPFILE``) temp file where the file system has them;
            False forces the named fallback (``.NAME.ckpt-tmp-PID-RANDOM``).
        durable: fsync the file before it is named and its folder after. False skips both
            (as ``cp`` does): still atomic (complete or absent) while the machine runs, but
            a power loss or kernel crash soon after may leave the name with missing or zero
            bytes. For scratch copies on disks where fsync is slow. Ignored when ``dst``
            exists: renamed over before its bytes are on disk, the old file could be lost
            as well as the new one (the yielded ``durable`` is then True).
        like: the file the output stands for (default ``dst``): it takes that file's mode
            and owner, and errors name it (a file of a folder output is written in a temp
            folder, gone by the time an error is read).

    Call :func:`~ckpt_tools.io.output_path.check_output_path` first. With ``replace``, a
    ``dst`` that exists when the write starts is replaced; one that appears while it runs
    never is.

    Raises:
        OutputError: the temp file cannot be created or written (disk full, permissions).
        OutputExistsError: ``dst`` exists and ``replace`` is False, or appeared while the
            output was written (nothing replaced).

    Example:
        >>> with atomic_output("notes.txt") as out:
        ...     _ = out.file.write(b"all or nothing")
        >>> open("notes.txt", "rb").read()
        b'all or nothing'
    """
    target = Path(dst)
    target = target.resolve().parent / target.name
    folder = target.parent
    # A file there now may be replaced where the caller said so (force, in place); one that
    # appears while the output is written never is. Renamed over a file whose new bytes are
    # not on disk, a power loss could lose both.
    existed = target.exists()
    if existed and not replace:  # it appeared after the output path was checked
        raise OutputExistsError(dst)
    durable = durable or existed
    remove_stale_temps(folder)
    with signals_raise() as release:
        try:
            fd, tmp, is_unnamed = _open_temp(target, unnamed)
        except OSError as e:
            raise OutputError(
                f"cannot create a temp file in {str(folder)!r}: {e.strerror}", path=dst
            ) from e
        f = os.fdopen(fd, "w+b")
        try:
            release()  # a signal noted since before the temp file existed is raised here
            with f:
                yield AtomicFile(f, tmp, durable)
                f.flush()
                keep_mode_and_owner(f.fileno(), like or target)
                if durable:
                    os.fsync(f.fileno())
                _test_pause()
                with naming(str(dst), lambda: fsync_folder(folder) if durable else None):
                    _name_it(f.fileno(), tmp, is_unnamed, target, replace=existed)
        except OSError as e:
            f.close()
            if not is_unnamed:
                tmp.unlink(missing_ok=True)
            if isinstance(e, CheckpointError):  # the output's own, or the input's (a URL's)
                raise
            shown = dst if like is None else like
            raise OutputError(
                f"writing {str(shown)!r} failed ({e.strerror or e}); nothing was written and "
                "the input is unchanged",
                path=shown,
            ) from e
        except BaseException:
            f.close()
            if not is_unnamed:
                tmp.unlink(missing_ok=True)
            raise
    if durable:
        fsync_folder(folder)
