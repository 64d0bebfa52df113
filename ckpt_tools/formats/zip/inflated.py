"""Compressed storage records (an archive re-zipped by a zip tool; torch inflates them) inflated
once into a temporary file, so that every reader takes their bytes as a span, as it takes a
stored record's.

A record is inflated the first time its span is asked for, appended to its archive's one copy
file in the system's temporary directory (``TMPDIR``), which lives as long as the process:
spans outlive the checkpoint that made them (a DeepSpeed folder's rank files are opened,
located and let go). On Linux the file has no name (``O_TMPFILE``, or unlinked at once) and
is read through ``/proc/self/fd``, so the kernel frees it however the process ends, SIGKILL
included; elsewhere it is removed at exit. A local file's record is inflated once per
process, however often the file is opened.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import tempfile
import threading
from typing import IO

from ckpt_tools.descriptors import ByteSpan
from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.zip.directory import ZipEntry
from ckpt_tools.formats.zip.records import inflate
from ckpt_tools.formats.zip.source import ZipSource
from ckpt_tools.structure.text import human_bytes

__all__ = ["InflatedCopies"]

# Every archive's copy file, open until the process ends: a path in /proc/self/fd stays its own.
_HELD: list[IO[bytes]] = []
_LOCK = threading.Lock()


class _Copies:
    """One archive's inflated records, back to back in one temporary file (one descriptor
    however many records: a model's thousands of tensors stay under ``ulimit -n``)."""

    def __init__(self) -> None:
        self.file: IO[bytes] | None = None
        self.path = ""
        self.at: dict[tuple[object, ...], int] = {}  # record -> where its bytes start
        self.end = 0


# A local archive's copies, by its file's identity.
_LOCAL: dict[tuple[int, ...], _Copies] = {}


class InflatedCopies:
    """The inflated copies of one archive's compressed records, each made on first use.

    Args:
        path: the archive, for messages and (``source`` None) to read.
        source: the remote file read by ranges, or None for a local file.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> # deflated.pt: model.pt re-zipped with deflate by a zip tool
        >>> ckpt = open_checkpoint("deflated.pt")
        >>> span = ckpt.span(ckpt.storages["0"])  # conv.weight: 8*3*3*3 float32
        >>> span.nbytes, os.path.getsize(span.path) >= span.offset + span.nbytes
        (864, True)
    """

    def __init__(self, path: str, source: ZipSource | None = None) -> None:
        self._path, self._source = path, source
        self._remote = _Copies()  # a remote archive's, made for this opening only

    def span(self, entry: ZipEntry) -> ByteSpan:
        """The span of ``entry``'s inflated bytes, inflating it the first time.

        Raises:
            CorruptCheckpointError: the record does not inflate to its declared size.
            ResourceLimitError: the temporary directory has no room for it.
            OSError: the file cannot be read, or the copy written.
        """
        with _LOCK:
            if self._source is not None:
                copies = self._remote
            else:
                found = os.stat(self._path)
                key = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
                key += (found.st_ctime_ns,)  # which no user sets back
                copies = _LOCAL.setdefault(key, _Copies())
            # The record as declared too: a file rewritten in place may keep size and times.
            record = (entry.name, entry.header_offset, entry.compress_size, entry.crc32)
            at = copies.at.get(record)
            if at is None:
                at = copies.at[record] = self._inflate(copies, entry)
        return ByteSpan(copies.path, at, entry.file_size)

    def _inflate(self, copies: _Copies, entry: ZipEntry) -> int:
        """Append ``entry``'s inflated bytes to ``copies``' file; where they start."""
        folder = tempfile.gettempdir()
        free = shutil.disk_usage(folder).free
        if entry.file_size > free:
            raise _no_room(self._path, entry, folder, free)
        if copies.file is None:
            copies.file, copies.path = _new_copy(folder)
            _HELD.append(copies.file)
        out, start = copies.file, copies.end
        with contextlib.ExitStack() as stack:
            source = self._source
            if source is None:
                source = os.open(self._path, os.O_RDONLY)
                stack.callback(os.close, source)
            out.seek(start)
            try:
                inflate(self._path, source, entry, out.write, check_crc=True)
                out.flush()
            except BaseException as e:
                out.truncate(start)  # nothing half made stays
                if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise _no_room(self._path, entry, folder, None) from e
                raise
        copies.end = start + entry.file_size
        return start


def _new_copy(folder: str) -> tuple[IO[bytes], str]:
    """A new file for an archive's copies, and the path it is read by."""
    if os.path.isdir("/proc/self/fd"):
        # No name (O_TMPFILE, or unlinked at once), and open until the process ends (_HELD).
        out = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115
        return out, f"/proc/self/fd/{out.fileno()}"
    named = tempfile.NamedTemporaryFile(  # noqa: SIM115 (open until the process ends)
        dir=folder, prefix="ckpt-inflated-", delete=False
    )
    atexit.register(_remove, named.name)
    return named, named.name


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _no_room(path: str, entry: ZipEntry, folder: str, free: int | None) -> ResourceLimitError:
    has = "has no room left" if free is None else f"has {human_bytes(free)} free"
    return ResourceLimitError(
        f"{path!r}: record {entry.name!r} is compressed and is inflated into the temporary "
        f"directory to be read, {human_bytes(entry.file_size)}, but {folder!r} {has}: set "
        "TMPDIR to a folder with room",
        path=path,
    )
