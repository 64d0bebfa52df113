"""How many bytes can still be written into the page cache before Linux paces the writer.

Linux lets a process dirty page cache freely up to the "freerun" ceiling, halfway between the
background writeback threshold and the dirty threshold (``dirty_freerun_ceiling`` in
``mm/page-writeback.c``). Past it, ``balance_dirty_pages`` limits the writer to about the
pace of the writeback: the page cache no longer takes bytes faster than the disk does. A
``--no-fsync`` copy larger than that room gains little from the page cache for the rest, and
pays for filling it (page allocation and a memory copy per page, and the eviction of other
files' cache). On this machine, 8 GiB copied by ``copy_file_range`` alone: through the page
cache 9.6 s (5 GiB at 0.3-0.9 s per GiB, then 2.1-2.6 s per GiB), straight to the disk 2.7 s;
``ckpt strip-module --no-fsync`` of an 8 GiB ``.pt``: 8.0 s all through the page cache, 3.4 s
with the part past the room direct, ``cp`` 7.2 s (benchmarks/README.md, issue 13, ninth pass).

The kernel publishes both thresholds in ``/proc/vmstat`` (``nr_dirty_threshold``,
``nr_dirty_background_threshold``, computed from ``vm.dirty_*`` and the dirtyable memory), and
what is dirty now (``nr_dirty``, ``nr_writeback``); the room is read from there, not
re-derived. It is the whole machine's room. Where the kernel also holds a writer to a smaller
one (a memory cgroup's own dirty limit in a container, a FUSE file system's per-device
limit), the figure is too large: the page cache is used longer than it pays, as before this
module, never less.
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
    sysconf = getattr(os, "sysconf", None)
    if sysconf is None:
        return None
    try:
        text = Path(VMSTAT if vmstat is None else vmstat).read_text()
        page = sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
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
