"""On-disk formats, torch-free: detect one, open it into a :class:`Checkpoint`.

A URL given to a reader of local files is refused here (:mod:`ckpt_tools.formats.urls`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ckpt_tools._types import StrPath, checked_path
from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.formats.detect import FORMATS, detect_format
from ckpt_tools.formats.urls import HIDDEN, refuse_url, shown_url

__all__ = [
    "FORMATS",
    "HIDDEN",
    "Checkpoint",
    "ZipRecord",
    "detect_format",
    "naming",
    "open_checkpoint",
    "refuse_url",
    "shown_url",
]


def open_checkpoint(path: StrPath) -> Checkpoint:
    """Open any supported checkpoint by content, reading only its structure.

    Args:
        path: a checkpoint file, a folder with ``*.index.json`` (HF sharded), or such an
            index itself (it opens with the shards it names).

    Returns:
        The opened :class:`Checkpoint`.

    Raises:
        UsageError: ``path`` is a URL (:func:`refuse_url`).
        CheckpointError: see :func:`detect_format` and the readers.

    Example:
        >>> ckpt = open_checkpoint("model.pt")
        >>> ckpt.format, sorted(ckpt.root)[:2]
        ('torch-zip', ['bn.bias', 'bn.num_batches_tracked'])
    """
    path = checked_path(path)
    with naming(path):
        return _open(path, detect_format(path))  # (which refuses a URL first)


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Make every corrupt-file or limit error raised in the block name ``path`` (a local
    path or a URL), as the one place that adds it.

    Low-level readers (pickle, tar) do not know the file name; every message names it.

    Args:
        path: the file being read, as the user gave it.

    Raises:
        CorruptCheckpointError, ResourceLimitError: the block's, prefixed with
            ``'path': `` unless the message names the file already.

    Example:
        >>> with naming("model.pt"):
        ...     raise CorruptCheckpointError("the pickle ends early")
        Traceback (most recent call last):
        ckpt_tools.errors.CorruptCheckpointError: 'model.pt': the pickle ends early
    """
    try:
        yield
    except (CorruptCheckpointError, ResourceLimitError) as e:
        if repr(path) in str(e) or path in str(e):
            raise
        raise type(e)(f"{path!r}: {e}") from e


def _open(path: str, fmt: str) -> Checkpoint:
    if fmt == "torch-zip":
        from ckpt_tools.formats.zip.torchzip import open_torch_zip

        return open_torch_zip(path)
    if fmt == "safetensors":
        from ckpt_tools.formats.safetensors import open_safetensors

        return open_safetensors(path)
    if fmt == "dcp":
        from ckpt_tools.formats.dcp.reader import open_dcp

        return open_dcp(path)
    if fmt == "deepspeed":
        from ckpt_tools.formats.deepspeed.reader import open_deepspeed

        return open_deepspeed(path)
    if fmt == "hf-sharded":
        from ckpt_tools.formats.hf import open_folder, open_index

        return open_folder(path) if os.path.isdir(path) else open_index(path)
    from ckpt_tools.formats.legacy import reader as legacy

    if fmt == "torch-legacy":
        return legacy.open_legacy(path)
    if fmt == "torch-tar":
        return legacy.open_tar(path)
    return legacy.open_pickle(path)
