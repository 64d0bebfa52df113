"""Writing torch zip archives, torch-free, with records copied straight from a source file.

Records are stored (not compressed) and their data starts on 64-byte boundaries, as torch
writes them, so outputs load with ``torch.load(mmap=True)``. Zip64 structures are written
when sizes or offsets need them.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import BinaryIO

from ckpt_tools.formats.zip.storage_offsets import StorageRecord, first_misplaced, in_key_order
from ckpt_tools.io.copy.clone import CopyCounts, Writeback, copy_range, pwrite_all
from ckpt_tools.io.ranges import fd_pread, pread_chunks

__all__ = [
    "ALIGNMENT",
    "PARSED_RECORDS",
    "SAVE_HEAD_RECORDS",
    "SAVE_VERSION",
    "TorchZipWriter",
    "Writeback",
    "copy_range",
    "pwrite_all",
]

ALIGNMENT = 64
# The bookkeeping records torch.save writes after data.pkl, with its values: every record
# written is aligned to ALIGNMENT, which .storage_alignment states.
SAVE_HEAD_RECORDS = (
    (".format_version", b"1"),
    (".storage_alignment", str(ALIGNMENT).encode()),
    ("byteorder", b"little"),
)
# The file format version torch.save writes (as the last record but the serialization id).
SAVE_VERSION = ("version", b"3\n")
# The records torch.load parses (not only reads): a rewrite writes them as torch.save does,
# never copies a source's bytes for them (".data/version" overrides "version" in torch's
# reader, and torch.save never writes it).
PARSED_RECORDS = frozenset(
    {name for name, _ in SAVE_HEAD_RECORDS} | {SAVE_VERSION[0], ".data/version"}
)
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
# Sizes and offsets from this value on, and entry counts from _ZIP64_ENTRIES on, need zip64
# records (the 32/16-bit fields then hold 0xFFFFFFFF/0xFFFF). Module constants apart from the
# field markers, so a test can move the thresholds down and check those records on small files.
_ZIP64_AT = _U32
_ZIP64_ENTRIES = _U16
# A fixed DOS date/time (1980-01-01 00:00), as torch's writer uses: outputs are reproducible.
_DOS_TIME, _DOS_DATE = 0, (0 << 9) | (1 << 5) | 1
_PAD_ID = 0x4246  # "FB", the padding extra field torch's writer uses
_UTF8 = 0x800  # names are UTF-8, as torch's writer flags them (zip tools read them so)
_LARGE_RECORD = 1 << 20
_LARGE_ALIGNMENT = 64 << 10
_WRITTEN_PAD = 4096


class _Entry:
    # One per record; a plain class, as its CRC-32 is filled in once its bytes are written.
    __slots__ = ("crc32", "data_offset", "flags", "header_offset", "name", "size")

    def __init__(
        self, name: bytes, offsets: tuple[int, int], size: int, crc32: int, flags: int = 0
    ) -> None:
        self.name = name
        self.header_offset, self.data_offset = offsets
        self.size = size
        self.crc32 = crc32
        self.flags = flags  # a copied local header's flags (data descriptor, UTF-8), repeated


class TorchZipWriter:
    """Build a torch zip archive record by record.

    Args:
        file: the output, opened ``w+b`` and empty (positions are tracked explicitly).
        root: the archive's root folder name (torch uses the file stem or ``archive``).
        durable: whether the output will be fsynced (``AtomicFile.durable``); the copies
            into it are made to suit (:class:`~ckpt_tools.io.copy.clone.Writeback`).

    Example:
        >>> import pickle, zipfile
        >>> with open("tiny.pt", "w+b") as f:
        ...     w = TorchZipWriter(f, "tiny", durable=False)
        ...     w.add_bytes("data.pkl", pickle.dumps({"epoch": 3}, protocol=2))
        ...     w.add_bytes("version", b"3")
        ...     w.close()
        >>> zipfile.ZipFile("tiny.pt").namelist()
        ['tiny/data.pkl', 'tiny/version']
    """

    def __init__(self, file: BinaryIO, root: str = "archive", *, durable: bool) -> None:
        self._file = file
        self._fd = file.fileno()
        self._root = root
        self._offset = 0
        self._entries: list[_Entry] = []
        self._writeback = Writeback(self._fd, durable=durable)
        self._end_at: tuple[int, int] | None = None
        self.copied = CopyCounts()  # bytes copied from sources, by method

    @property
    def offset(self) -> int:
        """Where the next record's local header goes."""
        return self._offset

    def end_next_record_at(self, residue: int, modulus: int) -> None:
        """Pad the next record's header so that its bytes end at ``residue`` modulo ``modulus``.

        A layout-preserving rewrite (:mod:`ckpt_tools.io.copy.layout`) calls this before the
        record that precedes a run of copied records, so the run lands at its source offset
        modulo the file system's block size. Storage records keep their 64-byte alignment
        first: where both cannot hold, the request is dropped.
        """
        self._end_at = (residue, modulus)

    def _local_header(self, name: bytes, size: int, crc32: int) -> tuple[bytes, int]:
        """The local header up to its padding, and how many padding bytes follow it."""
        zip64 = size >= _ZIP64_AT or self._offset >= _ZIP64_AT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        fixed = 30 + len(name) + len(extra) + 4
        pad = (-(self._offset + fixed)) % ALIGNMENT
        end_at, self._end_at = self._end_at, None
        if end_at is not None:
            wanted = (end_at[0] - self._offset - fixed - size) % end_at[1]
            storage = name.partition(b"/")[2].startswith(b"data/")
            if not storage or (self._offset + fixed + wanted) % ALIGNMENT == 0:
                pad = wanted
        elif size >= _LARGE_RECORD:
            # Large records start on a 64 KiB boundary, so kernel copies move whole pages
            # instead of splitting them at the record's start. The padding is left a hole.
            big = (-(self._offset + fixed)) % _LARGE_ALIGNMENT
            if big + len(extra) + 4 <= _U16:
                pad = big
        extra += struct.pack("<HH", _PAD_ID, pad)
        size32 = _U32 if zip64 else size
        head = (
            struct.pack(
                "<IHHHHHIIIHH",
                0x04034B50,
                45 if zip64 else 20,
                _UTF8,
                0,  # stored
                _DOS_TIME,
                _DOS_DATE,
                crc32,
                size32,
                size32,
                len(name),
                len(extra) + pad,
            )
            + name
            + extra
        )
        return head, pad

    def _begin(self, name: str, size: int, crc32: int) -> int:
        full = f"{self._root}/{name}".encode()
        header, pad = self._local_header(full, size, crc32)
        # Small paddings are written (as torch writes "Z"s); large ones stay a sparse hole,
        # which reads back as zeros: any bytes are valid content for the padding field.
        if pad <= _WRITTEN_PAD:
            header += b"Z" * pad
            pad = 0
        pwrite_all(self._fd, header, self._offset)
        start = self._offset + len(header) + pad
        self._entries.append(_Entry(full, (self._offset, start), size, crc32, _UTF8))
        self._offset = start
        return start

    def add_bytes(self, name: str, data: bytes) -> None:
        """Add a record holding ``data``."""
        start = self._begin(name, len(data), zlib.crc32(data))
        pwrite_all(self._fd, data, start)
        self._offset += len(data)

    def add_copy(
        self,
        name: str,
        src_fd: int,
        src_offset: int,
        size: int,
        crc32: int | None,
        counter: Callable[[int], None] | None = None,
    ) -> None:
        """Add a record whose bytes are copied from ``src_fd`` at ``src_offset``.

        Args:
            crc32: the bytes' CRC-32 when known (a zip source's record has it); None to compute
                it while copying (which reads the bytes through Python).
        """
        if crc32 is None:
            self._add_computed(name, src_fd, src_offset, size, counter)
            return
        start = self._begin(name, size, crc32)
        self.copied += copy_range(
            src_fd, src_offset, self._fd, start, size, counter, self._writeback
        )
        self._offset += size

    def add_run(
        self,
        src_fd: int,
        start: int,
        end: int,
        records: Sequence[tuple[str, int, int, int, int, int]],
        counter: Callable[[int], None] | None = None,
    ) -> bool:
        """Copy ``[start, end)`` of a zip source as it is: records with their local headers.

        Args:
            src_fd: the source archive.
            start: where the first record's local header starts in it.
            end: where the last record's bytes end.
            records: ``(name, local header offset, data offset, size, crc32, flags)`` in
                the source, of every record in the range (stored, headers and data
                descriptors checked by the caller); names under this writer's root folder.
            counter: told the byte counts as the range is copied.

        Returns:
            False, having written nothing, where a storage record would not start on an
            ``ALIGNMENT`` boundary at this position (``torch.load(mmap=True)`` needs that).
        """
        base = self._offset
        entries = []
        for name, header_offset, data_offset, size, crc32, flags in records:
            if name.startswith("data/") and (base + data_offset - start) % ALIGNMENT:
                return False
            full = f"{self._root}/{name}".encode()
            at = (base + header_offset - start, base + data_offset - start)
            entries.append(_Entry(full, at, size, crc32, flags))
        self._entries += entries
        self.copied += copy_range(
            src_fd, start, self._fd, base, end - start, counter, self._writeback
        )
        self._offset += end - start
        return True

    def add_stream(
        self,
        name: str,
        chunks: Iterable[bytes],
        size: int,
        counter: Callable[[int], None] | None = None,
    ) -> None:
        """Add a stored record from ``chunks`` (a decompressed record, piece by piece).

        Args:
            chunks: the record's bytes, in bounded pieces; their CRC-32 is computed here.
            size: how many bytes they add up to (the header is written first).

        Raises:
            OSError: the pieces add up to another size than ``size``, or writing failed.
        """
        header_at = self._offset
        start = self._begin(name, size, 0)
        crc, done = 0, 0
        for data in chunks:
            if done + len(data) > size:
                raise OSError(5, f"record {name!r} holds more than its declared {size} bytes")
            pwrite_all(self._fd, data, start + done)
            self._writeback.wrote(start + done, len(data))
            crc = zlib.crc32(data, crc)
            done += len(data)
            if counter is not None:
                counter(len(data))
        if done != size:
            raise OSError(5, f"record {name!r} ended after {done} of {size} bytes")
        pwrite_all(self._fd, struct.pack("<I", crc), header_at + 14)
        self._entries[-1].crc32 = crc
        self._offset += size

    def add_written(
        self, name: str, size: int, write: Callable[[int, int, Writeback], int]
    ) -> None:
        """Add a stored record of ``size`` bytes that ``write(fd, offset, writeback)`` fills.

        ``write`` puts exactly ``size`` bytes at ``offset`` of ``fd`` (copied spans, assembled
        slabs: :func:`ckpt_tools.io.assemble.write_pieces`) and returns their CRC-32.
        """
        header_at = self._offset
        start = self._begin(name, size, 0)
        crc = write(self._fd, start, self._writeback)
        pwrite_all(self._fd, struct.pack("<I", crc), header_at + 14)
        self._entries[-1].crc32 = crc
        self._offset += size

    def _add_computed(
        self,
        name: str,
        src_fd: int,
        src_offset: int,
        size: int,
        counter: Callable[[int], None] | None,
    ) -> None:
        chunks = pread_chunks(fd_pread(src_fd), src_offset, size)
        self.add_stream(name, chunks, size, counter)

    def _state_storage_layout(self) -> None:
        """Keep ``.format_version`` at ``1`` only where torch's computed storage offsets hold
        (:mod:`ckpt_tools.formats.zip.storage_offsets`); else make it ``0``, so torch reads
        each storage's own header. Records written anew or padded for copies lie elsewhere."""
        root = len(self._root.encode()) + 1  # names are UTF-8 bytes
        named = {e.name[root:]: e for e in self._entries}
        version = named.get(b".format_version")
        if version is None or version.size != 1:
            return
        storages = [
            StorageRecord(n[5:].decode(), len(e.name), e.header_offset, e.data_offset, e.size)
            for n, e in named.items()
            if n.startswith(b"data/")
        ]
        if first_misplaced(in_key_order(storages), ALIGNMENT) is None:
            return
        crc = zlib.crc32(b"0")
        pwrite_all(self._fd, b"0", version.data_offset)
        if version.flags & 0x08:  # a copied record: its CRC-32 is in the data descriptor
            after = os.pread(self._fd, 4, version.data_offset + 1)
            at = version.data_offset + 1 + (4 if after == b"PK\x07\x08" else 0)
        else:
            at = version.header_offset + 14
        pwrite_all(self._fd, struct.pack("<I", crc), at)
        version.crc32 = crc

    def close(self) -> None:
        """Write the central directory and end records. The file is not closed."""
        self._state_storage_layout()
        cd_start = self._offset
        directory = bytearray()
        for e in self._entries:
            zip64 = e.size >= _ZIP64_AT or e.header_offset >= _ZIP64_AT
            extra = b""
            if zip64:
                extra = struct.pack("<HHQQQ", 0x0001, 24, e.size, e.size, e.header_offset)
            directory += struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                45 if zip64 else 20,
                45 if zip64 else 20,
                e.flags,
                0,
                _DOS_TIME,
                _DOS_DATE,
                e.crc32,
                _U32 if zip64 else e.size,
                _U32 if zip64 else e.size,
                len(e.name),
                len(extra),
                0,
                0,
                0,
                0,
                _U32 if zip64 else e.header_offset,
            )
            directory += e.name + extra
        cd_size = len(directory)
        count = len(self._entries)
        end = bytes(directory)
        zip64_end = count >= _ZIP64_ENTRIES or cd_start >= _ZIP64_AT or cd_size >= _ZIP64_AT
        if zip64_end:
            zip64_end_at = cd_start + cd_size
            end += struct.pack(
                "<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start
            )
            end += struct.pack("<IIQI", 0x07064B50, 0, zip64_end_at, 1)
        end += struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            _U16 if zip64_end else count,
            _U16 if zip64_end else count,
            _U32 if zip64_end else cd_size,
            _U32 if zip64_end else cd_start,
            0,
        )
        pwrite_all(self._fd, end, self._offset)
        self._offset += len(end)
        os.ftruncate(self._fd, self._offset)
