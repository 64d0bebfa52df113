"""Declared output sizes, checked before any memory or disk is spent on them.

A view's size is what its shape declares, not what its storage holds: a storage of one
element viewed with shape ``(2**40,)`` and stride ``(0,)`` is 4 bytes in the input and 4 TiB
once written contiguous (safetensors). Such sizes are refused while planning, and every
output is checked against the free space of its folder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import OutputError, Remedy, ResourceLimitError

__all__ = ["MAX_EXPANSION_BYTES", "check_output_size"]

#: The most bytes a view may add over its storage when written contiguous (an ``expand``ed
#: tensor grows; a real checkpoint's views never grow by more than this).
MAX_EXPANSION_BYTES = 1 << 30


def _free_bytes(folder: str) -> int | None:
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None  # no statvfs here: the write itself will report a full disk
    return st.f_bavail * st.f_frsize


def check_output_size(
    tensors: Sequence[TensorRef], total: int, dst: str | os.PathLike[str]
) -> None:
    """Refuse an output whose declared size is implausible or larger than the free space.

    Args:
        tensors: tensors the output holds as contiguous copies (views are expanded).
        total: the bytes the output will hold, all records together.
        dst: the output path (its folder's file system is asked for free space).

    Raises:
        ResourceLimitError: a view grows by more than :data:`MAX_EXPANSION_BYTES` when made
            contiguous (exit 5).
        OutputError: ``total`` exceeds the free space of ``dst``'s folder (exit 6, as a disk
            that fills while writing).

    Example:
        >>> check_output_size([], 0, "out.pt")
    """
    grown = [t for t in tensors if t.nbytes - t.storage.nbytes > MAX_EXPANSION_BYTES]
    if grown:
        shown = ", ".join(f"{list(t.shape)} stride {list(t.stride)}" for t in grown[:3])
        raise ResourceLimitError(
            f"{len(grown)} view(s) would grow by more than {MAX_EXPANSION_BYTES >> 30} GiB when "
            f"written contiguous ({shown}); the largest declares {max(t.nbytes for t in grown)} "
            "bytes",
            path=dst,
            remedies=(Remedy(text="keep the torch format, which stores views as they are"),),
        )
    folder = os.path.dirname(os.path.abspath(dst))
    free = _free_bytes(folder)
    if free is not None and total > free:
        raise OutputError(
            f"the output needs {total} bytes and {folder!r} has {free} free",
            path=dst,
            remedies=(Remedy(text="free some space or write to another disk"),),
        )
