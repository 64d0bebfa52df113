"""The opened-checkpoint handle every format reader returns, and the file it reads from."""

from __future__ import annotations

import contextlib
import errno
import io
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from ckpt_tools._escape import shell_path
from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.errors import Remedy, UsageError

__all__ = [
    "Checkpoint",
    "RangeFile",
    "RangeSource",
    "ZipRecord",
    "consolidate_first",
    "open_buffered",
]


def consolidate_first(path: str, what: str) -> UsageError:
    """The refusal to read a sharded checkpoint (a DCP folder, a DeepSpeed ZeRO one) as one
    file: a usage refusal (exit 2), since ``consolidate`` reads it whole.

    Args:
        path: the checkpoint.
        what: what it is and why no tensor of it lies in one byte range, after its name.

    Example:
        >>> err = consolidate_first("run", "is a sharded checkpoint")
        >>> print(err)
        'run' is a sharded checkpoint; run `ckpt consolidate run OUT.pt` to write it as one ...
        >>> err.exit_code
        2
    """
    return UsageError(
        f"{path!r} {what}",
        path=path,
        remedies=(
            Remedy(
                command=f"ckpt consolidate {shell_path(path)} OUT.pt",
                text="to write it as one file first",
            ),
        ),
    )


class RangeSource(Protocol):
    """A file read by byte ranges instead of a descriptor: a remote file (``io/remote``)."""

    size: int

    def pread(self, count: int, offset: int) -> bytes: ...


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over :meth:`pread`, for the pickle reader: a subclass gives
    ``size`` and ``pread`` (a tar member, a remote object); it seeks, tells and reads as a
    file opened unbuffered does.

    Example:
        >>> class Letters(RangeFile):
        ...     size = 6
        ...     def pread(self, count, offset): return b"abcdef"[offset : offset + count]
        >>> f = Letters()
        >>> f.seek(-2, io.SEEK_END), f.read()
        (4, b'ef')
    """

    size: int
    _position = 0

    def pread(self, count: int, offset: int) -> bytes:
        """Up to ``count`` bytes at ``offset``; fewer where the file ends, as ``os.pread``."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        if base + offset < 0:  # as lseek refuses it
            raise OSError(errno.EINVAL, f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self.pread(len(buffer), self._position)
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


@contextlib.contextmanager
def open_buffered(path: str, source: RangeSource | None) -> Iterator[BinaryIO]:
    """``path`` as a buffered binary file, or ``source`` (the remote file at the URL
    ``path``) as one, from its start.

    Args:
        path: the file (its URL where ``source`` is given).
        source: the file read by ranges; None opens ``path``.

    Yields:
        The file; a local one is closed after, a remote one left open (its session
        closes it).

    Example:
        >>> with open_buffered("model.pt", None) as f:
        ...     f.read(2)
        b'PK'
    """
    if source is None:
        with open(path, "rb") as f:
            yield f
        return
    source.seek(0)  # type: ignore[attr-defined]  # (zipfile may have moved it)
    buffered = io.BufferedReader(source)  # type: ignore[arg-type]
    try:
        yield buffered
    finally:
        # Detached, not closed: collected, a buffer closes its raw file, and the remote
        # file is read again later (a record's bytes, a scan's walk).
        buffered.detach()


@dataclass(frozen=True)
class ZipRecord:
    """One record of a zip archive: its name, where its bytes start, and its checksum."""

    name: str
    data_offset: int
    size: int
    crc32: int
    compressed: bool
    header_offset: int = -1  # where its local header starts; -1 where unknown
    compress_size: int = -1  # its stored bytes (its size unless deflated); -1 where unknown


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: its object tree and where each storage's bytes lie.

    Attributes:
        path: the file (or folder) it was read from.
        format: one of :data:`ckpt_tools.formats.detect.FORMATS`.
        root: the object tree (dicts, lists, :class:`~ckpt_tools.descriptors.TensorRef` ...).
        storages: storage key -> descriptor, in file order.
        unsafe_globals: qualified names of globals outside the allowlist.
        protocol: the pickle protocol of the main pickle (0 for safetensors).
        beyond_weights_only: the main pickle's opcodes that ``torch.load(weights_only=True)``
            does not implement (it refuses the file; ``weights_only=False`` reads it alike).
        metadata: the safetensors ``__metadata__`` dict, if any.
        records: zip records (torch zip formats), by name inside the root folder.
        archive_root: the zip's root folder name (``archive``), for torch zip formats.
        shards: for sharded folders, shard file -> its own Checkpoint.
        locate: where a storage's bytes lie (:meth:`span`).
        probe: refuses a storage as :meth:`span` would, without reading its bytes; None
            where locating reads none (:meth:`check_span`).
        remote: for a checkpoint read from a URL, each remote file by its URL.
        byteorder: the byte order of its storages' elements, ``little`` unless a torch zip's
            byteorder record says ``big`` (torch.load byte-swaps those as it loads them).
        byteorder_recorded: whether a torch zip has a byteorder record; without one this
            reader takes it as ``little`` (torch's default), while ``torch.load`` follows
            ``torch.serialization.set_default_load_endianness`` (the loaders do too).
    """

    path: str
    format: str
    root: Any
    storages: Mapping[str, StorageRef]
    unsafe_globals: tuple[str, ...] = ()
    protocol: int = 0
    beyond_weights_only: tuple[str, ...] = ()
    metadata: Mapping[str, str] | None = None
    records: Mapping[str, ZipRecord] = field(default_factory=dict)
    archive_root: str = ""
    shards: Mapping[str, Checkpoint] = field(default_factory=dict)
    locate: Callable[[StorageRef], ByteSpan] | None = field(default=None, repr=False)
    probe: Callable[[StorageRef], None] | None = field(default=None, repr=False)
    # The remote files its bytes are read from, by URL: a span's path names one of them.
    # Empty for a local checkpoint.
    remote: Mapping[str, RangeSource] = field(default_factory=dict, repr=False)
    byteorder: str = "little"
    byteorder_recorded: bool = False

    def span(self, storage: StorageRef) -> ByteSpan:
        """Where ``storage``'s bytes lie in the file.

        Raises:
            KeyError: the storage does not belong to this checkpoint.
        """
        if self.locate is None:
            raise KeyError(f"{self.format} checkpoint has no byte locations")
        return self.locate(storage)

    def check_span(self, storage: StorageRef) -> None:
        """Refuse ``storage`` as :meth:`span` would, before anything is written, without
        making what a span needs made (a compressed record's inflated copy): a plan's check.

        Raises:
            KeyError: the storage does not belong to this checkpoint.
            CheckpointError: its bytes cannot be located (a remote record's local header).
        """
        if self.probe is not None:
            self.probe(storage)
        else:
            self.span(storage)
