"""The progress callback every writing operation takes, and the counter the writers feed.

Every operation that writes a file (rewrites, transforms, consolidate, sanitize, reshard)
takes ``progress: Progress | None`` and calls it with ``(done_bytes, total_bytes)``: tensor
bytes written so far, out of the tensor bytes the output will hold. The writers count those
bytes with one :class:`ByteCounter`, which the copy engine
(:func:`~ckpt_tools.io.copy.clone.copy_range`) calls with each piece's byte count.
"""

from __future__ import annotations

import threading

# Defined once with the other shared option types; the writers' callers import it from here.
from ckpt_tools._types import Progress

__all__ = ["ByteCounter", "Progress"]


class ByteCounter:
    """Adds up the byte counts the copy engine reports and tells a :data:`Progress`.

    One counter serves one output, whether its files are written by one thread or several
    (the shards of a folder): the sum is kept under a lock, so ``progress`` always sees a
    total that only grows.

    Args:
        progress: told ``(done, total)`` after every piece; None counts only.
        total: the tensor bytes the output will hold.

    Example:
        >>> seen = []
        >>> counter = ByteCounter(lambda done, total: seen.append((done, total)), 10)
        >>> counter(4); counter(6)
        >>> seen, counter.done
        ([(4, 10), (10, 10)], 10)
    """

    def __init__(self, progress: Progress | None, total: int) -> None:
        self._progress = progress
        self.total = total
        self.done = 0
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            done = self.done
            if self._progress is not None:
                self._progress(done, self.total)
