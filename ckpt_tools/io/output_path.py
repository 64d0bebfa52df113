"""What an output path may be, checked before any work: never the input (unless in place),
never a file an input folder's reader reads, a folder, a device or a FIFO; an existing file
only with ``force``. :mod:`~ckpt_tools.io.atomic` then writes it."""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_tools.errors import OutputError, OutputExistsError, SameFileError
from ckpt_tools.io.input_files import reads

__all__ = ["check_output_path"]


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
    in_place: bool | None = False,
) -> Path:
    """Refuse outputs that would clobber something, before any work is done.

    Args:
        dst: the output path.
        src: the input path, if any, to refuse writing over it.
        force: allow replacing an existing ``dst`` (never the input).
        in_place: allow ``dst`` to be ``src`` (still written through a temp file and rename);
            None where the operation has no such option, so the refusal does not offer it.

    Returns:
        The output path, with a symlink at ``dst`` resolved (the link is kept, its target
        replaced).

    Raises:
        SameFileError: ``dst`` is ``src`` and ``in_place`` is False, or a file the reader
            of a ``src`` folder reads (a shard, the index), whatever ``in_place``.
        OutputExistsError: ``dst`` exists and ``force`` is False.
        OutputError: ``dst`` is a folder, ends with ``/``, or is not a regular file (a
            device, a FIFO), or its folder does not exist or is a file.
    """
    if os.fspath(dst).endswith(("/", os.sep)):  # Path() drops the slash: a file would be named
        raise OutputError(
            f"output {os.fspath(dst)!r} ends with '/', which names a folder; give a file path "
            f"({os.fspath(dst).rstrip('/' + os.sep)!r})",
            path=dst,
        )
    out = Path(dst)
    if src is not None and out.exists():
        if Path(src).is_dir() and reads(src, out):  # a shard or the index: never, in place or not
            raise SameFileError(dst, offer_in_place=False, folder=src)
        if _same_file(Path(src), out):
            if not in_place:
                raise SameFileError(dst, offer_in_place=in_place is not None)
            return out.resolve()
    if out.is_dir():
        raise OutputError(f"output {str(dst)!r} is a folder; give a file path", path=dst)
    if out.exists() and not out.is_file():  # a device or a FIFO: never replaced by a file
        raise OutputError(f"output {str(dst)!r} is not a regular file; give a file path", path=dst)
    if out.exists() and not force:
        raise OutputExistsError(dst)
    folder = out.resolve().parent
    if not folder.is_dir():
        raise OutputError(
            f"the output folder {str(folder)!r} does not exist; create it first", path=dst
        )
    return out.resolve() if out.is_symlink() else out
