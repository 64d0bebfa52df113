"""An output folder published by one rename: written in a temp folder beside it, the old
folder's kept entries carried in, swapped into place, the old folder's weight files removed.

A folder output is complete or absent: a failed write puts back what it had carried out and
removes the temp folder; a killed one leaves what the next folder write beside it puts back
(:func:`~ckpt_tools.io.writers.folder_temp.remove_temp_folder`); a signal once the folder has
its name says it was written.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

from ckpt_tools.errors import OutputError
from ckpt_tools.io.atomic import fsync_folder
from ckpt_tools.io.interrupts import Interrupted, naming, signals_raise
from ckpt_tools.io.output_access import check_writable
from ckpt_tools.io.output_path import folder_exists_error, resolved_output
from ckpt_tools.io.temp_names import remove_orphans
from ckpt_tools.io.writers.folder_temp import (
    TEMP_FOLDER,
    exchange,
    remove_temp_folder,
    share_group,
    take_over,
    temp_folder,
)

__all__ = ["WEIGHT_FILES", "published_folder", "removed_files"]


# Temp folders: not `.ckpt-tmp-` (atomic.py's file pattern, whose cleanup unlinks files).


#: The files ``force`` replaces in an existing output folder: a checkpoint's weights as
#: transformers names them (single file, shards, index; safetensors and torch ``.bin``), a
#: variant's too (``save_pretrained(variant="fp16")``: ``model.fp16.safetensors``,
#: ``model.fp16-00001-of-00002.safetensors``, ``model.safetensors.index.fp16.json``; a dotted
#: variant whole: ``model.ema.v2.safetensors``), which ``from_pretrained(variant=)`` would
#: load as this folder's. Everything else in the folder (config.json, tokenizer files, notes,
#: subfolders) is kept.
WEIGHT_FILES = re.compile(
    r"^(?:model(?:\.[^/]+?)?(?:-\d+-of-\d+)?\.safetensors|model\.safetensors\.index(?:\.[^/]+)?\.json"
    r"|pytorch_model(?:\.[^/]+?)?(?:-\d+-of-\d+)?\.bin|pytorch_model\.bin\.index(?:\.[^/]+)?\.json)$"
)


def _kept(name: str) -> bool:
    """Whether a new output keeps this entry of the folder it replaces: all but weight files."""
    return not WEIGHT_FILES.match(name)


def _kept_entries(target: Path) -> list[str]:
    """The names in an existing ``target`` that a new output keeps."""
    if not target.is_dir():
        return []
    return sorted(filter(_kept, os.listdir(target)))


def removed_files(dst: str, written: Sequence[str]) -> tuple[str, ...]:
    """The files of an existing output folder that writing ``written`` into it removes.

    A write keeps everything of the old folder but its weight files (:data:`WEIGHT_FILES`),
    and those it writes anew are replaced: the rest are gone. A dry run lists them from
    here, so that its plan and the real run cannot disagree.

    Args:
        dst: the output folder as given (a symlink at it is followed, as the write does).
        written: the files the write would put there (their names, or paths ending in them).

    Returns:
        The paths (``dst`` joined with each name) of the weight files removed, sorted; none
        where ``dst`` is no folder yet.

    Example:
        >>> written = ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
        >>> removed_files("sharded", written)
        ('sharded/model-00002-of-00002.safetensors',)
    """
    target = resolved_output(dst)
    if not target.is_dir():
        return ()
    new = {os.path.basename(name) for name in written}
    old = sorted(n for n in os.listdir(target) if WEIGHT_FILES.match(n) and n not in new)
    return tuple(os.path.join(dst, name) for name in old)


def _carry(target: Path, tmp: Path, names: Sequence[str], moved: list[str]) -> None:
    """Put ``names`` of ``target`` into ``tmp``: a folder by rename (it keeps its owner, mode
    and inode), a file or symlink by a hard link (the original stays until the swap), each by
    the other where its own way fails.

    Every name is added to ``moved``, which the caller owns, before it is renamed: an error
    or a signal part way through still leaves the list of what to put back
    (:func:`_discard` puts back only what is in ``tmp`` and no longer in ``target``).
    """
    for name in names:
        src, dst = target / name, tmp / name
        if src.is_dir() and not src.is_symlink():
            try:
                moved.append(name)
                os.rename(src, dst)
                continue
            except OSError:  # not ours to move (its '..' not writable): a tree of links
                _link_tree(src, dst)
                continue
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            moved.append(name)
            os.rename(src, dst)


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` rebuilt at ``dst`` as folders of hard links to its files.

    Raises:
        OutputError: a file of it cannot be linked (another user's), named.
    """
    try:
        shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
    except shutil.Error as e:
        name, _, why = e.args[0][0]
        why = re.sub(r"^\[Errno \d+\] ([^:]*)(:.*)?$", r"\1", why)  # the reason, not paths
        raise OutputError(
            f"cannot keep {str(src)!r} in the new folder: it cannot be moved, nor {name!r} "
            f"linked ({why}); move it out of the folder, or write another one",
            path=str(src),
        ) from e


@contextlib.contextmanager
def published_folder(
    target: Path, durable: bool = True, replace: bool = False
) -> Iterator[tuple[Path, bool]]:
    """A temp folder beside ``target`` that becomes ``target`` when the body succeeds.

    Yields ``(temp folder, durable)``: whether to fsync what is written into it, as the
    folders are fsynced around the rename. That is ``durable``, or True when a non-empty
    ``target`` is replaced: renamed over before the new files are on disk, a power loss
    could lose the old folder as well as the new one.

    An existing ``target`` (checked by
    :func:`~ckpt_tools.io.output_path.check_output_folder`) keeps everything but its weight
    files: once the new files are complete, the kept entries are carried into the temp folder
    (folders renamed, files hard-linked; see :func:`_carry`), which takes the old folder's
    mode, owner and group
    (:mod:`~ckpt_tools.io.writers.folder_temp`); the old folder is moved aside, the temp
    folder takes its name, and the old one (its weight files) is removed. On any error the
    renamed entries go back and the temp folder goes; after a kill, the next folder write
    beside it puts them back (:func:`~ckpt_tools.io.writers.folder_temp.remove_temp_folder`).

    SIGTERM and SIGHUP raise :class:`~ckpt_tools.io.interrupts.Interrupted` in the main
    thread for the whole write (worker threads cannot), and are held during the swap.
    """
    parent = target.parent
    # First: a killed run's carried entries go back into ``target``, which is then read whole.
    remove_orphans(parent, TEMP_FOLDER, functools.partial(remove_temp_folder, kept=_kept))
    old = target.stat() if target.is_dir() else None
    replaced = old is not None and any(target.iterdir())
    if replaced and not replace:  # filled after check_output_folder accepted it
        raise folder_exists_error(str(target))
    durable = durable or replaced
    check_writable(target, target)
    tag = f"{os.getpid()}-{os.urandom(4).hex()}"  # as atomic.py names its temp files
    tmp = temp_folder(target, tag)
    published: list[bool] = []
    with _said_written(target, published), signals_raise() as release:
        try:
            tmp.mkdir(0o777 if old is None else 0o700)
        except OSError as e:
            raise OutputError(f"cannot create a folder in {str(parent)!r}: {e.strerror}") from e
        moved: list[str] = []
        try:
            release()  # a signal noted since before the temp folder existed is raised here
            share_group(tmp, old)
            try:
                yield tmp, durable
            except Interrupted as e:  # a shard named in the temp folder is no output
                raise Interrupted(e.signum) from None
            if replaced:
                _carry(target, tmp, _kept_entries(target), moved)
            take_over(tmp, old)
            if durable:
                fsync_folder(tmp)
            with naming(str(target)):  # both renames and the parent's fsync, or neither
                _swap(target, tmp, temp_folder(target, tag, aside=True), replaced)
                moved.clear()
                if durable:
                    fsync_folder(parent)
            published.append(True)
        except OSError as e:
            if isinstance(e, OutputError):
                raise  # (_swap's "already exists" among them)
            raise OutputError(
                f"writing {str(target)!r} failed ({e.strerror or e}); the input is unchanged",
                path=str(target),
            ) from e
        finally:
            _discard(tmp, target, moved)


@contextlib.contextmanager
def _said_written(target: Path, published: Sequence[bool]) -> Iterator[None]:
    """A signal once ``target`` has its name (``published``: while the old folder is
    removed) is an :class:`~ckpt_tools.io.interrupts.Interrupted` that says it was written."""
    try:
        yield
    except (Interrupted, KeyboardInterrupt) as e:
        if not published or getattr(e, "written", None) is not None:
            raise
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        raise Interrupted(signum, written=str(target)) from None


def _discard(tmp: Path, target: Path, moved: Sequence[str]) -> None:
    """Remove the temp folder (absent once swapped in); the entries renamed out of ``target``
    go back first. A second signal waits until this is done."""
    with signals_raise():
        for name in moved:
            if os.path.lexists(tmp / name) and not os.path.lexists(target / name):
                with contextlib.suppress(OSError):
                    os.rename(tmp / name, target / name)
        with contextlib.suppress(OSError):  # it may have the old folder's mode by now
            os.chmod(tmp, 0o700)
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(target: Path, tmp: Path, old: Path, replaced: bool) -> None:
    """Give ``tmp`` the name ``target``; an old non-empty ``target`` is swapped with it in one
    step where the file system can (else moved aside, put back if the rename fails), and
    removed once the new folder has its name.

    Raises:
        OutputExistsError: ``target``, absent or empty when the write began, was filled
            meanwhile (another writer published it first).
    """
    if replaced and exchange(tmp, target):
        shutil.rmtree(tmp, ignore_errors=True)  # (the old folder, now under the temp name)
        return
    if replaced:  # two renames where the file system cannot swap in one
        os.rename(target, old)
    try:
        os.rename(tmp, target)  # also replaces an empty folder
    except OSError as e:
        if replaced:
            os.rename(old, target)
        elif e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise folder_exists_error(str(target)) from e
        raise
    if replaced:
        shutil.rmtree(old, ignore_errors=True)
