"""On-disk formats, torch-free: detect one, open it into a :class:`Checkpoint`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ckpt_tools._types import StrPath
from ckpt_tools.errors import CorruptCheckpointError, Remedy, ResourceLimitError, UsageError
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.formats.detect import FORMATS, detect_format

__all__ = ["FORMATS", "Checkpoint", "ZipRecord", "detect_format", "naming", "open_checkpoint"]


# The URLs io/remote reads (open_url); here they are refused with the commands that read them.
_URL_SCHEMES = ("http", "https", "hf", "s3")


def open_checkpoint(path: StrPath) -> Checkpoint:
    """Open any supported checkpoint by content, reading only its structure.

    Args:
        path: a checkpoint file, a folder with ``*.index.json`` (HF sharded), or such an
            index itself (it opens with the shards it names).

    Returns:
        The opened :class:`Checkpoint`.

    Raises:
        CheckpointError: see :func:`detect_format` and the readers.

    Example:
        >>> ckpt = open_checkpoint("model.pt")
        >>> ckpt.format, sorted(ckpt.root)[:2]
        ('torch-zip', ['bn.bias', 'bn.num_batches_tracked'])
    """
    path = os.fspath(path)
    if path.partition("://")[0].lower() in _URL_SCHEMES and not os.path.exists(path):
        raise UsageError(
            f"{path!r} is a URL; inspect, scan, diff, extract and slim read URLs (only the "
            "bytes they need), other commands read local files",
            path=path,
            remedies=(Remedy(text="download the file and pass its path"),),
        )
    with naming(path):
        return _open(path, detect_format(path))


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
