"""Temp names beside an output, and what killed runs left under them.

A temp file is ``.NAME.ckpt-tmp-PID-RANDOM`` (:mod:`~ckpt_tools.io.atomic`), a temp folder
``.NAME.ckpt-tmpdir-PID-RANDOM`` (:mod:`~ckpt_tools.io.writers.folder_temp`): the owner's PID
tells a later run whether the owner still runs; NAME is cut to fit NAME_MAX where the whole
would not, in a way a later run reads back.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "NAME_MAX",
    "TEMP_SUFFIX",
    "fitted_name",
    "is_temp_file",
    "remove_orphans",
    "remove_stale_temps",
    "stands_for",
    "temp_name",
]

TEMP_SUFFIX = ".ckpt-tmp"
# `.NAME.ckpt-tmp-PID-RANDOM`: the owner's PID, so a later run can tell a stale temp file.
_TEMP_NAME = re.compile(r"^\..*\.ckpt-tmp-(\d+)-[0-9a-f]+$")
#: The longest name a folder entry may have, in bytes (every Linux file system's NAME_MAX).
NAME_MAX = 255
_CUT = re.compile(rb"~[0-9a-f]{8}$")  # how fitted_name ends a name it cut


def temp_name(target: Path) -> Path:
    """A temp file's name beside ``target``: ``.NAME.ckpt-tmp-PID-RANDOM``, NAME cut to fit."""
    tail = f"{TEMP_SUFFIX}-{os.getpid()}-{os.urandom(4).hex()}"
    return target.parent / f".{fitted_name(target.name, f'.{tail}')}{tail}"


def is_temp_file(name: str) -> bool:
    """Whether ``name`` is a temp file's (:func:`temp_name`): a write's, never a user's.

    Example:
        >>> [is_temp_file(n) for n in (".m.pt.ckpt-tmp-12-ab01", "m.pt", ".ckpt-tmp-x")]
        [True, False, False]
    """
    return _TEMP_NAME.match(name) is not None


def fitted_name(name: str, beside: str) -> str:
    """``name`` as the part of a temp name that ``beside`` completes: itself where the whole
    fits in NAME_MAX (255 bytes), else cut to fit and ended with ``~`` and a digest of the
    whole name, so a later run can tell which name it stood for (:func:`stands_for`).

    Example:
        >>> fitted_name("model.pt", ".ckpt-tmp-1-ab")
        'model.pt'
        >>> len(fitted_name("a" * 250, ".ckpt-tmp-1-ab").encode()) + 14
        255
    """
    raw, room = os.fsencode(name), NAME_MAX - len(os.fsencode(beside))
    if len(raw) <= room:
        return name
    import hashlib  # only here: a rewrite starts faster without it

    digest = hashlib.sha256(raw).hexdigest()[:8]
    return os.fsdecode(raw[: room - 9]) + "~" + digest


def stands_for(cut: str, beside: str, names: Sequence[str]) -> str | None:
    """The name of ``names`` (a folder's) that :func:`fitted_name` gave as ``cut``: ``cut``
    itself where it is one of them or no cut name; None where none of them was cut to it.

    Example:
        >>> stands_for("model.pt", ".x", [])
        'model.pt'
        >>> long = "a" * 250
        >>> stands_for(fitted_name(long, ".ckpt-tmp-1-ab"), ".ckpt-tmp-1-ab", ["b", long]) == long
        True
    """
    raw = os.fsencode(cut)
    looks_cut = len(raw) == NAME_MAX - len(os.fsencode(beside)) and _CUT.search(raw)
    if cut in names or not looks_cut:
        return cut
    return next((n for n in names if fitted_name(n, beside) == cut), None)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a PID no process can have
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_orphans(
    folder: str | os.PathLike[str], pattern: re.Pattern[str], remove: Callable[[Path], None]
) -> list[Path]:
    """Remove what killed runs left in ``folder``: the entries whose name ``pattern`` matches
    (its first group the owner's PID) and whose owner is not running.

    A concurrent run's entries are kept. (On a folder shared between machines, a PID is only
    meaningful on its own machine: such folders should be on a file system with
    ``O_TMPFILE``, or written from one machine at a time.)

    Args:
        folder: the folder to clean.
        pattern: names of the entries to consider, group 1 the owner's PID.
        remove: removes one entry (a file's unlink, a folder's rmtree).

    Returns:
        The entries removed.

    Example:
        >>> import re, tempfile
        >>> remove_orphans(tempfile.mkdtemp(), re.compile(r"^\\.x-(\\d+)$"), Path.unlink)
        []
    """
    removed: list[Path] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = Path(folder) / name
        # Gone already (another run removed it), or not ours to remove (another user's, in a
        # shared sticky folder; a read-only file system): the write itself does not need it.
        with contextlib.suppress(OSError):
            remove(path)
            removed.append(path)
    return removed


def remove_stale_temps(folder: str | os.PathLike[str]) -> list[Path]:
    """Remove temp files a killed ``ckpt`` left in ``folder`` (named ``.NAME.ckpt-tmp-PID-R``).

    Only files whose owner PID is not running are removed (see :func:`remove_orphans`).

    Args:
        folder: the folder to clean.

    Returns:
        The files removed.

    Example:
        >>> import tempfile
        >>> remove_stale_temps(tempfile.mkdtemp())
        []
    """
    return remove_orphans(folder, _TEMP_NAME, Path.unlink)
