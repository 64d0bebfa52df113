"""What an output may be, checked before any work.

A file output (:func:`check_output_path`) is never the input (unless in place), never a path
an input folder is read through (:func:`~ckpt_tools.io.input_files.shapes_reading`), a folder,
a device, a FIFO or a symlink loop; an existing file only with ``force``.
:mod:`~ckpt_tools.io.atomic` then writes it. A folder output (:func:`check_output_folder`)
never holds the input nor loops, and an existing one is filled only with ``force``;
:mod:`~ckpt_tools.io.writers.hf_folder` then writes it."""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ckpt_tools.errors import (
    CheckpointError,
    OutputError,
    OutputExistsError,
    Remedy,
    SameFileError,
    UsageError,
)
from ckpt_tools.formats.urls import refuse_url
from ckpt_tools.io.input_files import shapes_reading
from ckpt_tools.io.output_access import check_creatable, check_writable

__all__ = [
    "FORCE_REPLACES",
    "check_output_folder",
    "check_output_path",
    "folder_exists_error",
    "names_folder",
    "resolved_output",
    "wants_folder",
]


R = TypeVar("R")


def _output_errors(check: Callable[..., R]) -> Callable[..., R]:
    """A system error met while looking at the output path (a folder on it this process may
    not search, a name too long) is an :class:`OutputError` naming it: the output is refused,
    as when it cannot be written."""

    @functools.wraps(check)
    def checked(dst: str | os.PathLike[str], *args: object, **kwargs: object) -> R:
        try:
            return check(dst, *args, **kwargs)
        except CheckpointError:
            raise
        except OSError as e:
            raise OutputError(
                f"cannot use the output path {os.fspath(dst)!r}: {e.strerror or e}", path=dst
            ) from e

    return checked


def _same_file(a: Path, b: Path) -> bool:
    # samefile compares device and inode: it sees hard links and symlinks alike.
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@_output_errors
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
        UsageError: ``dst`` is a URL (outputs are local paths).
        SameFileError: ``dst`` is ``src`` and ``in_place`` is False, or a file the reader
            of a ``src`` folder reads (a shard, the index), whatever ``in_place``.
        OutputExistsError: ``dst`` exists and ``force`` is False.
        OutputError: ``dst`` is a folder, ends with ``/``, or is not a regular file (a
            device, a FIFO), or its folder does not exist or is a file; or it is a name a
            ``src`` folder (or the folder of a ``src`` file it is written beside) is read
            through (a new ``model.safetensors`` beside an index: refused unless ``force``),
            or it is or passes through a symlink loop.
    """
    refuse_url(dst, output=True)
    if names_folder(dst):  # Path() drops a final '/' or '/.': a file would be named
        raise OutputError(
            f"output {os.fspath(dst)!r} names a folder (it ends with '/', '.' or '..'); "
            "give a file path",
            path=dst,
        )
    _refuse_loop(dst)
    out = Path(dst)
    folder, form = _input_folder(src, out)
    if folder is not None and shapes_reading(folder, out, form=form):
        if out.exists():  # a shard or the index: never, in place or not
            raise SameFileError(dst, offer_in_place=False, folder=folder)
        if not force:
            raise OutputError(
                f"output {os.fspath(dst)!r} is a name the input folder {os.fspath(folder)!r} "
                "is read through: written there, it would change what the folder loads as",
                path=dst,
                remedies=(
                    Remedy(text="choose another output path"),
                    Remedy("force", "True", flag="--force", text="to write it there anyway"),
                ),
            )
    if src is not None and out.exists() and _same_file(Path(src), out):
        if not in_place:
            raise SameFileError(dst, offer_in_place=in_place is not None)
        _refuse_cache_blob(out.resolve(), dst)
        check_creatable(out.resolve().parent, dst, out.resolve())
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
    _refuse_cache_blob(out.resolve(), dst)
    check_creatable(folder, dst, out.resolve())
    return out.resolve() if out.is_symlink() else out


def _input_folder(src: str | os.PathLike[str] | None, out: Path) -> tuple[str | None, str | None]:
    """The folder whose reading an output must not change, and its format where known: the
    input folder, or the Hugging Face folder an input file is read as part of (a shard, the
    file ``from_pretrained`` loads) when the output is written beside it."""
    if src is None:
        return None, None
    if Path(src).is_dir():
        return os.fspath(src), None
    from ckpt_tools.formats.detect import is_index_name
    from ckpt_tools.formats.hf import files_read

    source = Path(src).resolve()
    try:
        beside = out.resolve().parent == source.parent
    except (OSError, RuntimeError):
        return None, None
    read = files_read(source.parent) if beside else None
    if read is None or source.name not in read:
        return None, None
    if out.exists() and _same_file(source, out) and not any(is_index_name(n) for n in read):
        return None, None  # the folder's one weight file, rewritten in place: it stays that
    return str(source.parent), "hf-sharded"


def _refuse_loop(dst: str | os.PathLike[str]) -> None:
    """Refuse an output that is, or passes through, a symlink loop: no file can be written
    there, and resolving it fails (``RuntimeError`` or ``OSError``, by Python version)."""
    try:
        os.stat(dst)
    except OSError as e:
        if e.errno != errno.ELOOP:
            return  # absent (or unreadable): the checks that follow say what is wrong
        raise OutputError(
            f"output {os.fspath(dst)!r} is or passes through a symlink loop (too many levels "
            "of symbolic links); no file can be written there",
            path=dst,
            remedies=(Remedy(text="remove the looping link, or choose another output path"),),
        ) from None


def names_folder(dst: str | os.PathLike[str]) -> bool:
    """Whether ``dst`` is spelled as a folder: it ends with a separator, or its last part is
    ``.`` or ``..`` (``Path`` drops a final ``/`` and ``/.``, so a file would be named).

    Example:
        >>> names_folder("out/"), names_folder("out/."), names_folder("out.pt")
        (True, True, False)
    """
    text = os.fspath(dst)
    return text.endswith(("/", os.sep)) or os.path.basename(text) in (".", "..")


def wants_folder(dst: str | os.PathLike[str], max_shard_size: str | int | None) -> bool:
    """An output is a Hugging Face folder when a shard size is given or ``dst`` names a folder
    (:func:`names_folder`, or an existing folder)."""
    return max_shard_size is not None or names_folder(dst) or os.path.isdir(os.fspath(dst))


#: What ``force`` does to an existing folder, in the words every refusal and help text uses.
FORCE_REPLACES = (
    "its weight files (model*.safetensors, pytorch_model*.bin and their index) and keep "
    "everything else"
)
# A sharded output is a folder: a name with a file's suffix is a mistake, not a folder name.
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl", ".safetensors")


@_output_errors
def check_output_folder(
    dst: str | os.PathLike[str], src: str | os.PathLike[str] | None = None, force: bool = False
) -> Path:
    """Refuse an output folder that would clobber something, before any work is done.

    Args:
        dst: the output folder (it may exist empty).
        src: the input file or folder; never replaced, nor any folder holding it.
        force: write into an existing non-empty ``dst``: its weight files
            (:data:`~ckpt_tools.io.writers.folder_swap.WEIGHT_FILES`) are replaced, everything
            else in it is kept.

    Returns:
        ``dst`` as an absolute path, a symlink at ``dst`` resolved (the link is kept, the
        folder it points to replaced).

    Raises:
        OutputError: ``dst`` is ``src``, or holds it (never replaced, even with ``force``).
        OutputExistsError: ``dst`` exists, is not empty, and ``force`` is False.
        OutputError: ``dst`` is a file, its parent folder does not exist, it is a folder
            this process could not write files into (replaced, it would be taken over), or
            it is or passes through a symlink loop.
        UsageError: ``dst`` is not a folder yet and its name has a file's suffix (``out.pt``),
            or is a URL.

    Example:
        >>> check_output_folder("sharded")
        Traceback (most recent call last):
        ckpt_tools.errors.OutputExistsError: output 'sharded' already exists; ...
    """
    refuse_url(dst, output=True)
    _refuse_loop(dst)
    out = resolved_output(dst)
    if src is not None:
        real_src, real_out = os.path.realpath(src), os.path.realpath(out)
        if os.path.commonpath([real_src, real_out]) == real_out:
            raise OutputError(
                f"output folder {os.fspath(dst)!r} is the input or holds it ({os.fspath(src)!r}); "
                "it is never replaced",
                path=dst,
                remedies=(Remedy(text="choose another output folder"),),
            )
    if out.exists() and not out.is_dir():
        raise OutputError(
            f"output {os.fspath(dst)!r} is a file; a sharded output is a folder", path=dst
        )
    if not out.exists() and out.name.lower().endswith(_FILE_SUFFIXES):
        raise UsageError(
            f"a sharded output is a folder, and {os.fspath(dst)!r} names a file",
            path=dst,
            remedies=(Remedy(text=f"name a folder, e.g. {Path(out.name).stem}/"),),
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise folder_exists_error(dst)
    _refuse_weight_named_folders(out, dst)
    check_writable(out, dst)
    if not out.parent.is_dir():
        raise OutputError(
            f"the output's parent folder {str(out.parent)!r} does not exist; create it first",
            path=dst,
        )
    check_creatable(out.parent, dst, out)
    return out


def _refuse_weight_named_folders(out: Path, dst: str | os.PathLike[str]) -> None:
    """A folder (or anything but a file) named as a weight file is no weight file to replace,
    and keeping it would leave it where the new weights go: refused, named."""
    from ckpt_tools.io.writers.folder_swap import WEIGHT_FILES

    if not out.is_dir():
        return
    odd = sorted(n for n in os.listdir(out) if WEIGHT_FILES.match(n) and not (out / n).is_file())
    if odd:
        what = "a weight file but not a file" if len(odd) == 1 else "weight files but not files"
        raise OutputError(
            f"output folder {os.fspath(dst)!r} holds {', '.join(map(repr, odd))}, named as "
            f"{what}: neither replaced nor kept",
            path=dst,
            remedies=(Remedy(text="move it away, or choose another output folder"),),
        )


def folder_exists_error(dst: str | os.PathLike[str]) -> OutputExistsError:
    """The refusal of an output folder that is not empty, with what ``force`` would do to it:
    the same words whether it was found before the write or only at its final rename.

    Args:
        dst: the output folder, as the caller named it.

    Returns:
        The error, to raise.

    Example:
        >>> str(folder_exists_error("sharded")).split(";")[0]
        "output 'sharded' already exists"
    """
    err = OutputExistsError(dst)
    err.remedies = (
        Remedy("force", "True", flag="--force", text=f"to replace {FORCE_REPLACES}"),
        *err.remedies[1:],
    )
    return err


@_output_errors
def resolved_output(dst: str | os.PathLike[str]) -> Path:
    """``dst`` as an absolute path; a symlink at it resolved, as file outputs resolve theirs."""
    out = Path(os.path.abspath(dst))
    return Path(os.path.realpath(out)) if out.is_symlink() else out


def _refuse_cache_blob(target: Path, dst: str | os.PathLike[str]) -> None:
    """Refuse to replace a Hugging Face cache blob (``models--org--name/blobs/HASH``) through
    a snapshot's link to it: every snapshot sharing the blob would change, and the blob would
    no longer hold what its name (the hash of its bytes) says."""
    cache_entry = target.parent.parent.name.startswith(("models--", "datasets--", "spaces--"))
    if target.parent.name != "blobs" or not cache_entry or target == Path(os.path.abspath(dst)):
        return
    raise OutputError(
        f"output {os.fspath(dst)!r} links to the Hugging Face cache blob {str(target)!r}: "
        "replacing it would change every snapshot that shares it",
        path=dst,
        remedies=(Remedy(text="write to another path; the cache keeps the downloaded file"),),
    )
