"""A cast storage's record, cast run by run as torch casts each tensor on it.

torch's cast kernel picks a NaN's bits by its place in the run of elements it casts at once:
a contiguous tensor is one run from its first element, not from its storage's. So a storage
holding views is not cast as one run: each tensor's run is cast on its own, and its elements
get the bits ``tensor.to(dtype)`` gives them. Where views overlap, the elements they share
are cast in the first view's run.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ckpt_tools.descriptors import StorageRef, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.writers.records import (
    Record,
    cast_storage_record,
    cast_stream,
    copy_record,
)

__all__ = ["cast_run", "run_bounds", "storage_cast_record"]


def cast_run(t: TensorRef) -> tuple[int, int] | None:
    """The run of elements torch's ``t.to(dtype)`` casts at once: ``(first, count)``, in
    elements of ``t``'s storage, from its lowest element; None for an empty tensor.

    Exact for a contiguous tensor, and for one laid out densely in another dimension order
    where the kernel sweeps memory (float64 -> bfloat16). torch casts a view with gaps row by
    row, or element by element, and picks the NaN bits of that path by dtype pair; such a
    view is cast here as one run over its span.

    Args:
        t: a dense tensor.

    Returns:
        ``(first, count)``, or None.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> s = StorageRef("0", "float64", 40, "cpu")
        >>> cast_run(TensorRef(s, 5, (2, 3), (3, 1), "float64"))
        (5, 6)
    """
    if t.numel == 0:
        return None
    first, end = (b // itemsize(t.dtype) for b in t.byte_span)
    return first, end - first


def run_bounds(views: Sequence[TensorRef], numel: int) -> list[int] | None:
    """Where a storage's cast runs start and end: each stretch between two bounds is cast as
    a tensor of its own (its first element first, its length the element count).

    Args:
        views: the tensors on the storage, in the output's order (where two overlap, the
            elements they share are cast in the first one's runs).
        numel: the storage's element count.

    Returns:
        The sorted bounds, from 0 to ``numel``; None when the storage is cast as one run (a
        tensor over all of it, or none).

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> s = StorageRef("0", "float64", 100, "cpu")
        >>> run_bounds([TensorRef(s, 0, (10,), (1,), "float64")], 100)
        [0, 10, 100]
    """
    starts: list[int] = []
    ends: list[int] = []
    for view in views:
        run = cast_run(view)
        if run is None:
            continue
        first, count = run
        i = bisect.bisect_right(starts, first)
        if (i and ends[i - 1] > first) or (i < len(starts) and starts[i] < first + count):
            continue  # shared with an earlier view's run, whose cast it takes
        starts.insert(i, first)
        ends.insert(i, first + count)
    if not starts or (starts, ends) == ([0], [numel]):
        return None
    return sorted({0, numel, *starts, *ends})


def storage_cast_record(
    ckpt: Checkpoint,
    storage: StorageRef,
    src: str,
    dst: str,
    views: Sequence[TensorRef],
    source: Record | None = None,
) -> Record:
    """A record of ``storage`` cast to ``dst``, each of ``views``' runs cast on its own.

    Args:
        ckpt: the checkpoint ``storage`` lies in.
        storage: the storage cast (elements of ``src``).
        src: its dtype.
        dst: the dtype cast to.
        views: the tensors on it, in the output's order (the first wins where two overlap).
        source: the record that makes the storage's bytes instead of a copy (a mean).

    Returns:
        The :class:`~ckpt_tools.io.writers.records.Record` of the cast storage.

    Example:
        >>> from ckpt_tools.io.writers.records import record_bytes
        >>> s = StorageRef("0", "float32", 4, "cpu")
        >>> zeros = Record(16, produce=lambda: [bytes(16)])
        >>> view = TensorRef(s, 1, (2,), (1,), "float32")
        >>> cast = storage_cast_record(None, s, "float32", "bfloat16", [view], zeros)
        >>> cast.nbytes, b"".join(record_bytes(cast)) == bytes(8)
        (8, True)
    """
    bounds = run_bounds(views, storage.nbytes // itemsize(src))
    if bounds is None and source is None:
        return cast_storage_record(ckpt, storage, src, dst)
    return cast_stream(source or copy_record(ckpt, storage), src, dst, runs=bounds)
