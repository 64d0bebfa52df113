"""How many bytes can still be written into the page cache before Linux paces the writer.

Linux lets a process dirty page cache freely up to the "freerun" ceiling, halfway between the
background writeback threshold and the dirty threshold (``dirty_freerun_ceiling`` in
``mm/page-writeback.c``). Past it, ``balance_dirty_pages`` slows the writer towards the pace
of the writeback: the bytes still go to the disk before the copy can go on. A ``--no-fsync``
copy larger than that room gains nothing from the page cache for the rest, and pays for
filling it (page allocation and a memory copy per page, the writeback's own pace, and the
eviction of other files' cache): on this machine an 8 GiB copy through the page cache took
9.6 s (5 GiB at 0.3-0.9 s per GiB, then 2.1-2.6 s per GiB), `cp` 18.3 s, and the same bytes
written straight to the disk 2.7 s (benchmarks/README.md, issue 13, ninth pass).

The kernel publishes both thresholds in ``/proc/vmstat`` (``nr_dirty_threshold``,
``nr_dirty_background_threshold``, computed from ``vm.dirty_*`` and the dirtyable memory), and
what is dirty now (``nr_dirty``, ``nr_writeback``); the room is read from there, not
re-derived. It is the whole machine's room: a memory cgroup's own dirty limit can be lower,
and then the page cache is used longer than it pays, as before this module.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["VMSTAT", "dirty_room"]

#: Where the kernel's counters are read from by default.
VMSTAT = Path("/proc/vmstat")
_FIELDS = ("nr_dirty_threshold", "nr_dirty_background_threshold", "nr_dirty", "nr_writeback")


def dirty_room(vmstat: str | os.PathLike[str] | None = None) -> int | None:
    """Bytes that can be dirtied now before the kernel starts pacing writers.

    Args:
        vmstat: a file of the kernel's counters; default :data:`VMSTAT`.

    Returns:
        ``(threshold + background threshold) / 2 - (dirty + under writeback)``, in bytes, at
        least 0; ``None`` where the counters are missing or unreadable (not Linux).

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix="vmstat") as f:
        ...     _ = f.write("nr_dirty 100\\nnr_writeback 28\\n"
        ...                 "nr_dirty_threshold 1000\\nnr_dirty_background_threshold 500\\n")
        ...     f.flush()
        ...     dirty_room(f.name) == (750 - 128) * os.sysconf("SC_PAGE_SIZE")
        True
        >>> dirty_room("/nonexistent/vmstat") is None
        True
    """
    try:
        text = Path(VMSTAT if vmstat is None else vmstat).read_text()
        page = os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
    counts: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _FIELDS:
            try:
                counts[name] = int(value)
            except ValueError:
                return None
    if len(counts) < len(_FIELDS):
        return None
    freerun = (counts["nr_dirty_threshold"] + counts["nr_dirty_background_threshold"]) // 2
    dirty = counts["nr_dirty"] + counts["nr_writeback"]
    return max(freerun - dirty, 0) * page
