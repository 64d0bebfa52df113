"""A strict re-read of a written torch zip archive: does ``torch.load`` parse it as written?

``torch.load(weights_only=True)`` and ``torch.load(mmap=True)`` read a record's bytes in
place, at the offset its local header gives, without decompressing; and its unpickler
executes a fixed set of opcodes. This check holds every output to that, from the bytes on
disk: one root folder, unique names, every record stored (never compressed), its local
header agreeing with the central directory, its bytes inside the file, storages starting on
64-byte boundaries, small records' CRC-32s, and ``data.pkl``'s opcodes.
"""

from __future__ import annotations

import os

from ckpt_tools.errors import (
    CheckpointError,
    CorruptCheckpointError,
    VerificationError,
)
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.zip.directory import ZipEntry, read_zip_directory
from ckpt_tools.formats.zip.records import crc_holds
from ckpt_tools.formats.zip.storage_offsets import StorageRecord, first_misplaced, in_key_order
from ckpt_tools.io.writers.zipfile import ALIGNMENT

__all__ = ["check_source_crcs", "check_torch_zip"]

_SMALL = 1 << 20  # records up to this size have their CRC-32 checked (torch's bookkeeping)


def check_source_crcs(ckpt: Checkpoint) -> None:
    """Refuse, before anything is written, a zip input whose small records fail their CRC-32.

    A rewrite copies records as they are, CRC included, and its verification checks the
    CRC-32 of every record up to ``_SMALL`` bytes: the same records are checked here first, so
    a damaged input is refused (exit 4) instead of failing verification after writing (exit 6).

    Raises:
        CorruptCheckpointError: a stored record up to ``_SMALL`` bytes does not match its CRC.
    """
    if ckpt.format not in ("torch-zip", "torchscript") or not ckpt.records:
        return
    fd = os.open(ckpt.path, os.O_RDONLY)
    try:
        for name, record in ckpt.records.items():
            if record.compressed or record.size > _SMALL:
                continue
            if not crc_holds(os.pread(fd, record.size, record.data_offset), record.crc32):
                raise CorruptCheckpointError(
                    f"{ckpt.path!r}: record {name!r} fails its CRC-32 check (the file is "
                    "damaged); a copy of it would not be a valid archive",
                    path=ckpt.path,
                )
    finally:
        os.close(fd)


def _fail(why: str) -> VerificationError:
    return VerificationError(f"the written archive is not one torch.load reads: {why}")


def _entries(path: str, fd: int) -> list[ZipEntry]:
    """The archive's records, through the same directory reader every input goes through."""
    try:
        return read_zip_directory(path, fd, os.fstat(fd).st_size)
    except CheckpointError as e:
        raise _fail(e.message) from e


def check_torch_zip(path: str, opened: Checkpoint | None = None) -> int:
    """Check that the torch zip archive at ``path`` is laid out as ``torch.load`` reads it.

    The directory is read by :func:`ckpt_tools.formats.zip.directory.read_zip_directory`, which
    already holds every record to its local header, to the file's bounds, and to unique
    names; this adds what an output must be on top: stored records, one root folder,
    aligned storages, CRC-32s of the small records, and ``data.pkl``'s opcodes.

    Args:
        path: the written archive (a temp file's ``/proc/self/fd/N`` path works too).
        opened: the same file as :func:`~ckpt_tools.formats.open_checkpoint` just read it
            (a verification reads the output first): its records are that same directory
            reader's, already held to one root folder, so the directory is not read again.

    Returns:
        How many records were checked.

    Raises:
        VerificationError: the first way the archive departs from what torch reads.

    Example:
        >>> check_torch_zip("model.pt")  # data.pkl, 17 storages, and torch's small records
        23
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if opened is not None and opened.path == path and opened.format == "torch-zip":
            records = [
                (name, r.compressed, r.data_offset, r.size, r.crc32)
                for name, r in opened.records.items()
            ]
        else:
            records = _records(path, fd)
        for name, compressed, offset, size, crc in records:
            if compressed:
                raise _fail(f"record {name!r} is compressed")
            if name.startswith("data/") and offset % ALIGNMENT:
                raise _fail(f"storage {name!r} starts at {offset}, not {ALIGNMENT}-aligned")
            if size <= _SMALL or name == "data.pkl":
                payload = os.pread(fd, size, offset)
                if not crc_holds(payload, crc):
                    raise _fail(f"record {name!r} fails its CRC-32 check")
                if name == "data.pkl":
                    _check_pickle(payload)
                if name == ".format_version" and payload.strip() >= b"1":
                    _check_computed_offsets(path, fd, opened)
    finally:
        os.close(fd)
    if "data.pkl" not in {r[0] for r in records}:
        raise _fail("it has no data.pkl record")
    return len(records)


def _check_computed_offsets(path: str, fd: int, opened: Checkpoint | None) -> None:
    """A ``.format_version`` of 1 tells torch it may compute each storage's offset from the
    one before (:mod:`~ckpt_tools.formats.zip.storage_offsets`): those offsets must be the
    real ones, in the order the pickle loads the storages."""
    entries = _entries(path, fd)
    cut = len(entries[0].raw_name.split(b"/", 1)[0]) + 1 if entries else 0
    records = {
        r.key: r
        for r in (
            StorageRecord(
                e.raw_name[cut + 5 :].decode(),
                len(e.raw_name),
                e.header_offset,
                e.data_offset,
                e.file_size,
            )
            for e in entries
            if e.raw_name[cut:].startswith(b"data/")
        )
    }
    if opened is not None and opened.path == path and set(opened.storages) == set(records):
        ordered = [records[key] for key in opened.storages]  # as the pickle first names them
    else:
        ordered = in_key_order(list(records.values()))
    key = first_misplaced(ordered, ALIGNMENT)
    if key is not None:
        raise _fail(
            f"its .format_version lets torch compute where storage {key!r} lies, and that is "
            "not where it lies"
        )


def _records(path: str, fd: int) -> list[tuple[str, bool, int, int, int]]:
    """Each record's name inside the one root folder, compressed, data offset, size, CRC."""
    entries = _entries(path, fd)
    roots = {e.name.split("/", 1)[0] for e in entries}
    if len(roots) != 1:
        raise _fail(f"its records lie under {len(roots)} root folders, not one")
    cut = len(roots.pop()) + 1
    return [(e.name[cut:], e.compressed, e.data_offset, e.file_size, e.crc32) for e in entries]


def _check_pickle(payload: bytes) -> None:
    # Imported here: a rewrite checks its zip source's CRCs through this module before it
    # writes, and only an output's data.pkl needs the pickle machinery.
    from ckpt_tools.formats.pickle.repickle import check_weights_only_pickle

    check_weights_only_pickle(payload, what="data.pkl", error=_fail)
