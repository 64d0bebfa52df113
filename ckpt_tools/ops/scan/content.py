"""What a file is by content, for ``scan``: its format, or a pickle a loader would read.

A file of no format the detector knows is still a checkpoint where it holds a pickle: torch
reads the first pickle of any file that is no zip, and ``pickle.load`` any pickle at all.
Its pickles are walked to the end of the file, never judged on their first bytes alone.
"""

from __future__ import annotations

import os

from ckpt_tools.errors import CheckpointError, LfsPointerError, UnsupportedFormatError
from ckpt_tools.formats import detect_format
from ckpt_tools.formats.base import RangeSource
from ckpt_tools.formats.detect import detect_bytes
from ckpt_tools.formats.pickle.imports import python3_qualname, starts_like_pickle
from ckpt_tools.formats.pickle.npy import NPY_MAGIC
from ckpt_tools.ops.scan.severity import classify, could_import
from ckpt_tools.ops.scan.sources import Walked, is_npz, walk_pickles

__all__ = ["content_format", "not_a_checkpoint"]


def _detect(path: str, source: RangeSource | None) -> str:
    """The format by content alone, of a local file or of the remote file at ``path``."""
    if source is None:
        return detect_format(path, content_only=True)
    return detect_bytes(
        path, source.size, source.pread(512, 0), lambda n: source.pread(n, 0), content_only=True
    )


def content_format(
    path: str, source: RangeSource | None = None
) -> tuple[str | None, list[Walked] | None]:
    """The format by content (``pickle`` for any file that parses as one, None for others),
    and for a pickle the walk of its pickles to the end of the file, where it ended cleanly:
    the scan's own walk of that format is the same one.

    Raises:
        LfsPointerError: a git-lfs pointer named as a checkpoint (``*.safetensors``,
            ``*.pt``, ``*.bin`` ...): the file was never pulled. Other pointers (images,
            datasets) are no checkpoint.
    """
    try:
        fmt = _detect(path, source)
    except LfsPointerError:
        if path.lower().endswith((*_CHECKPOINT_SUFFIXES, ".safetensors")):
            raise  # a checkpoint never pulled: nothing of it can be judged
        return None, None
    except UnsupportedFormatError:
        if source is None and not os.path.isfile(path):
            raise
        if source is not None:
            head = source.pread(1 << 16, 0)
        else:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
        if head.startswith(NPY_MAGIC):  # numpy.load reads it; its pickle, if any, is walked
            return "numpy", None
        walks = _pickle_walks(path, head, source)
        return (None, None) if walks is None else ("pickle", walks or None)
    if fmt == "torch-zip" and is_npz(path, source):
        return "numpy", None
    return (None if fmt == "hf-sharded" else fmt), None  # an index: its shards are scanned


def _pickle_walks(path: str, head: bytes, source: RangeSource | None) -> list[Walked] | None:
    """The pickles of a file of no other format, walked to the end of the file (a payload
    may lie anywhere), where a loader reads it as a pickle; None where none does; empty where
    one does but the walk stopped on an error (the scan walks it again and reports that).

    Any opcode can start one (a damaged legacy file's magic number is one long integer); a
    pickle cut short or refused counts where it imports something first, since a loader
    performs that import before it fails, and a broken one where it starts with a PROTO or
    is named as a checkpoint (``model.bin``): other text merely looks like protocol 0."""
    walks: list[Walked] = []
    try:
        walks.extend(walk_pickles(path, "pickle", source=source))
    except CheckpointError:
        if any(w.scan.imports for w in walks):
            return []
        raise
    if not walks:
        return None
    first, imports = walks[0].scan, any(w.scan.imports for w in walks)
    if first.end is not None:
        holds = imports or starts_like_pickle(head, any_protocol=True)
    elif head[:1] == b"\x80" or path.lower().endswith(_CHECKPOINT_SUFFIXES):
        holds = imports  # a PROTO, or a checkpoint's name: a pickle, cut short or broken
    else:
        holds = _payload(walks)
    return walks if holds else None


def _payload(walks: list[Walked]) -> bool:
    """Whether a walk calls a global the table calls dangerous (``os.system``, and any it
    does not know, as ``imaplib.IMAP4_stream``), or calls one it can import (or changes one
    in place) beside importing such a global: a gadget calls what it is handed
    (``copyreg._reconstructor(Popen, ...)``), and ``os.environ`` filled runs nothing yet
    changes what runs. A loader does it before the bytes break, whatever the file is named.
    Text that merely reads as protocol 0 names a global (``cos`` then ``sin``: ``os.sin``)
    but calls nothing, or calls one no loader can import (a Lisp file's ``(in-package ...)``)."""
    scans = [w.scan for w in walks]
    acts = any(could_import(i) for s in scans for i in (*s.called, *s.mutated))
    return acts and any(
        classify(python3_qualname(i.qualname)).severity == "dangerous"
        for s in scans
        for i in s.imports
        if could_import(i)
    )


# The names torch.load's files go by: one that fails as a pickle is still a payload's place.
_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".tar")


def not_a_checkpoint(path: str, source: RangeSource | None = None) -> str:
    """Why ``path`` is no checkpoint, in the format detector's words (a git-lfs pointer
    says how to fetch the file)."""
    try:
        _detect(path, source)
    except CheckpointError as e:
        return str(e)
    return f"{path!r} is not a checkpoint (by content)"
