"""Compressed storage records (an archive re-zipped by a zip tool; torch inflates them) inflated
once into a temporary file, so that every reader takes their bytes as a span, as it takes a
stored record's.

A copy is made the first time a record's span is asked for, in a private folder of the
system's temporary directory (``TMPDIR``), and removed with the checkpoint that made it (or
at exit): a span outliving it fails to open rather than read another file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref

from ckpt_tools.descriptors import ByteSpan
from ckpt_tools.formats.zip.directory import ZipEntry
from ckpt_tools.formats.zip.records import inflate
from ckpt_tools.formats.zip.source import ZipSource

__all__ = ["InflatedCopies"]


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
        >>> span.offset, span.nbytes, os.path.getsize(span.path)
        (0, 864, 864)
    """

    def __init__(self, path: str, source: ZipSource | None = None) -> None:
        self._path, self._source = path, source
        self._copies: dict[str, str] = {}
        self._lock = threading.Lock()
        self._folder: str | None = None

    def span(self, entry: ZipEntry) -> ByteSpan:
        """The span of ``entry``'s inflated bytes, inflating it the first time.

        Raises:
            CorruptCheckpointError: the record does not inflate to its declared size.
            OSError: the copy cannot be written (the temporary directory is full).
        """
        with self._lock:
            copy = self._copies.get(entry.name)
            if copy is None:
                copy = self._copies[entry.name] = self._inflate(entry)
        return ByteSpan(copy, 0, entry.file_size)

    def _inflate(self, entry: ZipEntry) -> str:
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="ckpt-inflated-")
            weakref.finalize(self, shutil.rmtree, self._folder, True)
        copy = os.path.join(self._folder, str(len(self._copies)))
        with contextlib.ExitStack() as stack:
            source = self._source
            if source is None:
                source = os.open(self._path, os.O_RDONLY)
                stack.callback(os.close, source)
            out = stack.enter_context(open(copy, "xb"))
            try:
                inflate(self._path, source, entry, out.write)
            except BaseException:
                os.unlink(copy)
                raise
        return copy
