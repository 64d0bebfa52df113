"""Whether this process may write an output where it is asked to, asked before the work (a dry
run included): the folder takes a new file, an entry it replaces may be renamed over (a sticky
folder keeps another user's), an existing output folder may be written into.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ckpt_tools.errors import OutputError, Remedy

__all__ = ["check_creatable", "check_folder_writable", "check_writable"]

_CAP_FOWNER = 3  # (linux/capability.h)


def check_creatable(folder: Path, dst: str | os.PathLike[str], target: Path) -> None:
    """Refuse an output whose folder takes no new file (its temp file, or temp folder, is made
    there), or where the rename onto ``target`` would be refused (a sticky folder, ``/tmp``'s
    kind, keeps another user's entries): found before the work, and by a dry run, which
    writes nothing to find it out. Asked without making a file, so no signal can land while
    one is open.

    Args:
        folder: where the output's temp file (or folder) would be made.
        dst: the output, as the caller named it.
        target: what the output would be renamed onto (it may not exist).

    Raises:
        OutputError: the folder takes no new file, or ``target`` may not be replaced.
    """
    if not _may_enter_and_write(folder):
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        why = "read-only file system" if read_only else "permission denied"
        problem = f"cannot create a file in {str(folder)!r}, where {os.fspath(dst)!r} would be"
        raise OutputError(
            f"{problem} written: {why}",
            path=dst,
            remedies=(Remedy(text="make the folder writable, or choose another output path"),),
        )
    if not _may_replace(folder, target):
        raise OutputError(
            f"cannot replace {str(target)!r}: another user's, in a sticky folder (as /tmp is) "
            "where only its owner or the folder's may rename over it",
            path=dst,
            remedies=(Remedy(text="choose another output path"),),
        )


def _may_enter_and_write(folder: Path) -> bool:
    """Whether this process, by its effective ids, may create entries in ``folder``."""
    effective = os.access in os.supports_effective_ids
    return os.access(folder, os.W_OK | os.X_OK, effective_ids=effective)


def _may_replace(folder: Path, target: Path) -> bool:
    """Whether this process may rename onto ``target`` in ``folder``: in a sticky folder only
    the owner of the entry or of the folder may, or a process with ``CAP_FOWNER``."""
    try:
        folder_st, target_st = os.stat(folder), os.lstat(target)
    except OSError:  # (nothing to replace)
        return True
    owners = (folder_st.st_uid, target_st.st_uid)
    if not folder_st.st_mode & stat.S_ISVTX or os.geteuid() in owners:
        return True
    try:
        with open("/proc/self/status", "rb") as status:
            caps = next(line for line in status if line.startswith(b"CapEff:"))
        return bool(int(caps.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return os.geteuid() == 0


def check_writable(out: Path, dst: str | os.PathLike[str]) -> None:
    """Refuse an existing folder this process could not write into, as ``cp -r`` and
    ``rsync`` would: replacing it needs only the parent's write permission, but would hand
    someone's read-only folder over to this process."""
    if out.is_dir() and not _may_enter_and_write(out):
        raise OutputError(
            f"cannot write into the output folder {os.fspath(dst)!r}: permission denied",
            path=dst,
            remedies=(Remedy(text="make it writable, or choose another output folder"),),
        )


def check_folder_writable(folder: Path, dst: str | os.PathLike[str], **where: str) -> None:
    """Create a nameless file in ``folder`` and drop it: what would refuse a file there
    (permissions, a read-only mount, ``/proc``) refuses it now, where :func:`os.access` says
    yes to root. Not for every output: a signal that lands while the probe is open would
    end the process before its writer holds signals (harness ``--plot`` uses it).

    Args:
        folder: where the output's temp file (or folder) would be made.
        dst: the output, as the caller named it.
        where: ``argument``, ``value`` and ``flag`` of the error, where an option names it.

    Raises:
        OutputError: the file cannot be made there.
    """
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise OutputError(
            f"cannot create a temp file in {str(folder)!r}: {e.strerror or e}", path=dst, **where
        ) from e
