"""Pickles back to back, walked where ``pickle.load`` of a buffered file reads them.

torch reads a legacy file's five pickles (and a plain pickle's first) with ``pickle.load`` from
``open(path, "rb")``. Each load starts where the last left the file: just past its STOP,
unless a FRAME the STOP lies inside was read whole, which leaves the file at the frame's end
(:class:`~ckpt_tools.formats.pickle.opcode_reader.FramedInput`). A frame shorter than
:data:`~ckpt_tools.formats.pickle.opcode_reader.PREFETCH` may instead be served from the
file's buffer, whose size is the loading machine's (the file system's block size), so both
readings are walked: every pickle either could reach is walked, in torch's order.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import BinaryIO

from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.base import RangeSource, open_buffered
from ckpt_tools.formats.pickle.imports import ImportScan, find_imports

__all__ = ["buffered_walks", "sequence_pickles"]

# Each way a buffered file may read the frames of one pickle, and each place a next pickle
# may start, is a walk; a file that makes more than this many is refused, never half-walked.
_MOST_WALKS = 64
# Pickles back to back, however small, are all walked up to this many (a log written by
# pickle.dump in a loop holds tens of thousands); a file of more is refused (a verdict no
# better than unreadable), never called clean on part of it.
_MOST_PICKLES = 1 << 20


def buffered_walks(f: BinaryIO, start: int, *, cut_globals: bool = False) -> list[ImportScan]:
    """The pickle at ``start`` of ``f`` walked each way ``pickle.load`` of a buffered file
    may read it: every frame it read whole that a buffer may serve instead, served too.

    Args:
        f: the file, seekable.
        start: where the pickle begins.
        cut_globals: as :func:`~ckpt_tools.formats.pickle.imports.find_imports`'s.

    Returns:
        One :class:`ImportScan` per distinct reading, the unbuffered one first.

    Raises:
        CorruptCheckpointError: its frames make more readings than are walked.

    Example:
        >>> import pickle
        >>> [w.end for w in buffered_walks(io.BytesIO(pickle.dumps([1], 4)), 0)]
        [17]
    """
    todo, tried, found = [frozenset[int]()], set[frozenset[int]](), list[ImportScan]()
    while todo:
        served = todo.pop(0)
        if served in tried:
            continue
        if len(tried) >= _MOST_WALKS:
            raise CorruptCheckpointError(
                f"the pickle at offset {start} holds FRAMEs that a loader's file buffer reads in "
                f"more than {_MOST_WALKS} ways; it is not walked further"
            )
        tried.add(served)
        scan = find_imports(f, start, cut_globals=cut_globals, served=served)
        if scan not in found:
            found.append(scan)
        todo.extend(served | {frame} for frame in sorted(scan.unsettled))
    return found


def sequence_pickles(
    path: str,
    most: int | None,
    names: tuple[str, ...],
    source: RangeSource | None = None,
) -> Iterator[tuple[str, ImportScan]]:
    """Pickles back to back from the start of ``path`` (``source`` read by ranges where it is
    a URL): the ``names`` ones whatever they hold (a loader reads each), then each further one
    that is a whole pickle, or that names a global before it breaks (a loader reading in order
    meets that global first); at most ``most`` (None: to the last).

    Returns:
        ``(record, scan)`` for each pickle walked, in the order a loader reads them.

    Raises:
        CorruptCheckpointError: FRAMEs make more ways to read the file than are walked, or
            it holds more pickles than are walked.
    """
    # torch.load reads the first pickle of any file that is no zip (a plain pickle's too, as
    # a legacy file's magic number) with its weights-only reader, and the named ones after.
    read_by_torch = max(len(names), 1)
    with open_buffered(path, source) as f:
        size = f.seek(0, io.SEEK_END)
        starts, walks = [0], 0
        for index in range(_MOST_PICKLES if most is None else most):
            record = names[index] if index < len(names) else f"pickle {index + 1}"
            following: list[int] = []
            for other, start in enumerate(s for s in starts if s < size):
                scans = buffered_walks(f, start, cut_globals=index < read_by_torch)
                walks += len(scans) - 1 + bool(other)  # (each reading past one per pickle)
                if walks > _MOST_WALKS:
                    raise CorruptCheckpointError(
                        f"{path!r}: its FRAMEs make more than {_MOST_WALKS} ways to read its "
                        "pickles; they are not walked further"
                    )
                for scan in scans:
                    if index and index >= len(names) and scan.end is None and not scan.imports:
                        continue  # what follows the last pickle is not one
                    yield record, scan
                    if scan.after is not None and scan.after not in following:
                        following.append(scan.after)
            if not following:
                return
            starts = following
        if most is None and any(s < size for s in starts):
            raise CorruptCheckpointError(
                f"{path!r} holds more than {_MOST_PICKLES} pickles back to back; those after "
                "them are not walked"
            )
