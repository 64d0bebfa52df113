"""Where a DeepSpeed checkpoint's files are: the save folder, ``latest``, the tag folder.

``engine.save_checkpoint(save_dir, tag)`` writes ``save_dir/latest`` (the tag, as text) and
``save_dir/<tag>/`` with the rank files, named as DeepSpeed's engine names them:

* ``mp_rank_{mp:02d}_model_states.pt``: the model states (ZeRO 0, 1 and 2), written once;
* ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``: one per data-parallel rank (ZeRO-3);
* ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``: each rank's optimizer
  partition (``bf16_`` when training in bf16).

A run is opened from its save folder (the tag ``latest`` names, or one given) or from a tag
folder itself.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_tools._escape import shell_word
from ckpt_tools.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    Remedy,
    UnsupportedFormatError,
    UsageError,
)

__all__ = [
    "LATEST",
    "OFFLOADED",
    "ZeroFiles",
    "find_zero_files",
    "is_deepspeed_folder",
    "tags_in",
]

#: The file in the save folder that names the newest tag.
LATEST = "latest"
#: The folder of a tag whose optimizer states were offloaded to NVMe: the rank files then
#: hold empty fp32 groups, the partitions lie in DeepSpeed's swap files.
OFFLOADED = "offloaded_tensors"
_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d\d+)_model_states\.pt")
_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d\d+)_optim_states\.pt")
# A tag is a folder name DeepSpeed made from the user's tag: read as text, never a path.
_MAX_TAG_BYTES = 4096


@dataclass(frozen=True)
class ZeroFiles:
    """A DeepSpeed tag folder's rank files, ordered by data-parallel rank.

    Attributes:
        folder: the tag folder.
        tag: its name.
        save_dir: the save folder it was found from (None: given as the tag folder).
        model_files: the model states files, by data-parallel rank (one below ZeRO-3).
        optim_files: the optimizer states files, by data-parallel rank.
        others: every other file in the tag folder, sorted.
    """

    folder: str
    tag: str
    save_dir: str | None
    model_files: tuple[str, ...]
    optim_files: tuple[str, ...]
    others: tuple[str, ...]

    def path(self, name: str) -> str:
        """The full path of a file of the tag folder."""
        return os.path.join(self.folder, name)

    def count_error(
        self, names: Sequence[str], world: int, what: str, recorded_by: str
    ) -> CorruptCheckpointError:
        """The refusal for ``names`` (rank files, ranks 0..N-1) that are not ``world`` files:
        the files past the last rank are named as extra, or the ranks whose files are missing.

        Example:
            >>> files = ZeroFiles("run/t", "t", "run", ("m.pt",), ("r0.pt", "r1.pt", "r2.pt"), ())
            >>> files.count_error(files.optim_files, 2, "optimizer states", "r0.pt").message
            "'r0.pt' records 2 data-parallel partitions, but 'run/t' holds 3 optimizer states \
files: 'r2.pt' is extra (left by an earlier save?)"
        """
        if len(names) > world:
            extra = ", ".join(repr(n) for n in names[world:])
            verb = "is" if len(names) == world + 1 else "are"
            which = f"{extra} {verb} extra (left by an earlier save?)"
        else:
            ranks = ", ".join(str(r) for r in range(len(names), world))
            one = len(names) + 1 == world
            which = f"the file{'' if one else 's'} of data-parallel rank{'' if one else 's'} "
            which += f"{ranks} {'is' if one else 'are'} missing"
        return CorruptCheckpointError(
            f"{recorded_by!r} records {world} data-parallel partitions, but {self.folder!r} "
            f"holds {len(names)} {what} files: {which}",
            path=self.folder,
        )


_TAG_DEPTH = 8


def tags_in(save_dir: str) -> list[str]:
    """The tag folders of a save folder, sorted: ``global_step2``, and those a tag of several
    folders nests (``save_checkpoint(dir, tag="epoch1/step2")``), up to 8 folders deep.

    Example:
        >>> tags_in(".")
        []
    """
    found: list[str] = []
    todo = [(os.fspath(save_dir), "")]
    while todo:  # a walk that stops at tag folders, and at links that loop by its depth
        folder, tag = todo.pop()
        for name in _names(folder):
            path = os.path.join(folder, name)
            if _has_rank_files(path):
                found.append(tag + name)
            elif tag.count("/") < _TAG_DEPTH - 1 and os.path.isdir(path):
                todo.append((path, f"{tag}{name}/"))
    return sorted(found)


def _names(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:  # not a folder, or one this process may not read: no tag
        return []


def _has_rank_files(folder: str) -> bool:
    return any(_MODEL.fullmatch(n) for n in _names(folder))


def is_deepspeed_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a DeepSpeed save folder (a ``latest`` file, or tag folders: one
    saved with ``save_latest=False`` has none) or a tag folder (model states files).

    Example:
        >>> is_deepspeed_folder(".")
        False
    """
    p = os.fspath(path)
    if os.path.isfile(os.path.join(p, LATEST)) or _has_rank_files(p):
        return True
    try:
        return bool(tags_in(p))
    except OSError:
        return False


def _read_latest(save_dir: str) -> str:
    where = os.path.join(save_dir, LATEST)
    with open(where, "rb") as f:
        raw = f.read(_MAX_TAG_BYTES + 1)
    tag = raw.decode("utf-8", "replace").strip()
    if len(raw) > _MAX_TAG_BYTES or not tag:
        raise CorruptCheckpointError(f"{where!r} does not hold a tag name", path=where)
    return tag


def _check_tag(save_dir: str, tag: str, latest: str | None) -> str:
    """The tag folder ``tag`` names in ``save_dir``: the caller's ``tag``, or ``latest``'s.

    A ``tag`` the caller passed (``consolidate --tag``) is a bad argument (a UsageError,
    exit 2, as a ``select`` naming nothing), fixed by another one. One that ``latest`` names
    is the checkpoint's own fault, and may have been met by any command that reads the
    folder, most of which take no tag: the fix said is a tag folder as the input, which all
    of them take.
    """
    # A tag may be folders within the save folder (DeepSpeed joins it as a path), never
    # one that leads out of it.
    bad = any(p in ("", ".", "..") for p in tag.split("/")) or any(c in tag for c in "\\\0")
    folder = os.path.join(save_dir, tag)
    if bad or not os.path.isdir(folder):
        tags = tags_in(save_dir)
        there = f" (tags there: {', '.join(tags[:5])})" if tags else ""
        if latest is None:
            raise UsageError(
                f"not a folder in {save_dir!r}{there}",
                path=folder,
                argument="tag",
                value=repr(tag),
                flag="--tag",
                remedies=[Remedy("tag", repr(t), flag=f"--tag {shell_word(t)}") for t in tags[:3]],
            )
        examples = [shell_word(os.path.join(save_dir, t)) for t in tags[:1]]
        raise CorruptCheckpointError(
            f"{latest!r} names tag {tag!r}, which is not a folder in {save_dir!r}{there}",
            path=folder,
            remedies=[Remedy(text=f"open a tag folder instead, e.g. {e}") for e in examples],
        )
    return folder


def find_zero_files(path: str | os.PathLike[str], tag: str | None = None) -> ZeroFiles:
    """Find a DeepSpeed checkpoint's tag folder and its rank files.

    Args:
        path: the save folder (with ``latest``) or a tag folder.
        tag: the tag to open in a save folder (default: the one ``latest`` names).

    Returns:
        The :class:`ZeroFiles`.

    Raises:
        CheckpointNotFoundError: ``path`` is not a folder.
        UsageError: ``tag`` names no tag folder, or none is given for a save folder without
            ``latest`` (the tags there are named).
        CorruptCheckpointError: ``latest`` names no folder, the folder holds no model
            states, or its rank files do not run 0..N-1.
        UnsupportedFormatError: model-parallel (``mp_rank_01``) or pipeline files.

    Example:
        >>> find_zero_files("run").tag  # doctest: +SKIP
        'global_step2'
        >>> find_zero_files("sharded")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.CorruptCheckpointError: 'sharded' holds no *_model_states.pt file, ...
    """
    save_dir = os.fspath(path)
    if not os.path.isdir(save_dir):
        raise CheckpointNotFoundError(f"no such folder: {save_dir!r}", path=save_dir)
    if tag is not None:
        folder = _check_tag(save_dir, tag, None)
    elif os.path.isfile(os.path.join(save_dir, LATEST)):
        tag = _read_latest(save_dir)
        folder = _check_tag(save_dir, tag, os.path.join(save_dir, LATEST))
    elif not _has_rank_files(save_dir) and tags_in(save_dir):
        raise _no_latest(save_dir)
    else:
        folder, save_dir, tag = save_dir, None, os.path.basename(os.path.abspath(save_dir))
    return _rank_files(folder, tag, save_dir)


def _no_latest(save_dir: str) -> UsageError:
    """A save folder without ``latest`` (``save_checkpoint(save_latest=False)``): which tag
    to read is the caller's to say, as ``zero_to_fp32``'s ``tag`` argument."""
    tags = tags_in(save_dir)
    return UsageError(
        f"{save_dir!r} is a DeepSpeed save folder without a {LATEST!r} file to name its tag; "
        f"its tags: {', '.join(repr(t) for t in tags[:5])}{' ...' if len(tags) > 5 else ''}",
        path=save_dir,
        remedies=[Remedy("tag", repr(t), flag=f"--tag {shell_word(t)}") for t in tags[:3]],
    )


def _rank_files(folder: str, tag: str, save_dir: str | None) -> ZeroFiles:
    models: dict[int, str] = {}
    optims: dict[int, str] = {}
    others: list[str] = []
    for name in sorted(os.listdir(folder)):
        model, optim = _MODEL.fullmatch(name), _OPTIM.fullmatch(name)
        match = model or optim
        if match is None:
            others.append(name)
            continue
        mp = int(match.group(2) if model else match.group(3))
        if mp != 0:
            raise UnsupportedFormatError(
                f"{os.path.join(folder, name)!r} is a model-parallel rank's file (mp_rank "
                f"{mp}); only data-parallel ZeRO checkpoints (mp_rank_00) are read",
                path=folder,
            )
        found, rank = (models, int(model.group(1) or 0)) if model else (optims, int(match.group(2)))
        if rank in found:
            raise CorruptCheckpointError(
                f"{folder!r} holds two files of data-parallel rank {rank}: {found[rank]!r} and "
                f"{name!r}",
                path=folder,
            )
        found[rank] = name
    if OFFLOADED in others:
        raise UnsupportedFormatError(
            f"{folder!r} was saved with its optimizer states offloaded to NVMe ({OFFLOADED}/): "
            "its rank files hold no fp32 partitions, so it is not read",
            path=folder,
        )
    if not models:
        raise CorruptCheckpointError(
            f"{folder!r} holds no *_model_states.pt file, so it is not a DeepSpeed tag folder",
            path=folder,
        )
    for what, found in (("model states", models), ("optimizer states", optims)):
        if found and sorted(found) != list(range(len(found))):
            missing = sorted(set(range(max(found) + 1)) - set(found))
            raise CorruptCheckpointError(
                f"{folder!r}: the {what} files of data-parallel ranks {missing} are missing",
                path=folder,
            )
    return ZeroFiles(
        folder=folder,
        tag=tag,
        save_dir=save_dir,
        model_files=tuple(models[r] for r in sorted(models)),
        optim_files=tuple(optims[r] for r in sorted(optims)),
        others=tuple(others),
    )
