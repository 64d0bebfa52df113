"""Why a local path names nothing, said as it is: no such file, a symlink whose target is gone
(a hub cache snapshot whose blob never arrived), a symlink loop, a file used as a folder."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from ckpt_tools.errors import CheckpointNotFoundError

__all__ = ["dangling", "missing"]

# What ``Path.exists`` takes for "nothing there"; any other failure to stat is raised.
_MISSING = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP})


def missing(path: str) -> CheckpointNotFoundError | None:
    """The error to raise when ``path`` names nothing; None when it names something.

    Args:
        path: a local path, as the user gave it.

    Returns:
        None, or a :class:`CheckpointNotFoundError` whose message says why nothing is there.

    Raises:
        OSError: stat failed for another reason (a folder that cannot be entered).

    Example:
        >>> missing(".") is None
        True
    """
    try:
        os.stat(path)
    except OSError as e:
        if e.errno not in _MISSING:
            raise
        return CheckpointNotFoundError(_why(path, e.errno), path=path)
    except ValueError:  # a NUL in the path
        return CheckpointNotFoundError(_why(path, errno.ENOENT), path=path)
    return None


def dangling(folder: str, names: Iterable[str]) -> CheckpointNotFoundError | None:
    """The error for the first of ``names`` in ``folder`` that is a symlink to nothing (a hub
    cache snapshot's weights whose blob never arrived); None where none is.

    Example:
        >>> dangling(".", ["model.safetensors"]) is None
        True
    """
    for name in names:
        path = os.path.join(folder, name)
        if os.path.islink(path) and not os.path.exists(path):
            return missing(path)
    return None


def _why(path: str, code: int | None) -> str:
    if code == errno.ELOOP:
        return f"{path!r}: a symlink loop (too many levels of symbolic links)"
    if code == errno.ENOTDIR:
        # The nearest part of the path that is a file (``model.pt/`` names a folder).
        head = path.rstrip(os.sep)
        while head and not os.path.isfile(head):
            head = os.path.dirname(head).rstrip(os.sep)
        if head:
            return f"{path!r}: {head!r} is a file, not a folder"
    if os.path.islink(path):  # the link is there, what it points to is not
        end = os.path.realpath(path)  # the end of a chain, from the link's own folder
        return f"{path!r} is a symlink to {os.readlink(path)!r}, and {end!r} does not exist"
    where = os.getcwd()
    return f"no such file or folder: {path!r}; check the path (relative paths start at {where!r})"
