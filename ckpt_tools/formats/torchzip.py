"""Reading torch zip archives (``torch.save`` since 1.6, and TorchScript archives).

Only the central directory, the local headers and ``data.pkl`` are read; storage records
are located, never loaded.
"""

from __future__ import annotations

import io
import os

from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.formats.pickles import MAX_PICKLE_BYTES, load_pickle
from ckpt_tools.formats.zipdir import ZipEntry, read_entry, read_zip_directory

__all__ = ["open_torch_zip"]

# Records a TorchScript archive has and a torch.save archive never has.
_TORCHSCRIPT_MARKERS = ("constants.pkl", "bytecode.pkl")
# torch reads ``version`` (or ``.data/version``) and refuses an archive without it.
_VERSION_RECORDS = (".data/version", "version")
_SMALL_RECORD = 64


def _archive_root(entries: list[ZipEntry], path: str) -> str:
    """The folder torch reads from: the first record's top folder (as PyTorchStreamReader).

    A record outside that folder is invisible to torch; a ``data.pkl`` there would be read
    by a reader that looked for it elsewhere, so any such record is refused.
    """
    if not entries:
        raise CorruptCheckpointError(f"{path!r} is a zip archive without records", path=path)
    root, slash, _ = entries[0].name.partition("/")
    if not slash or not root:
        raise CorruptCheckpointError(
            f"{path!r}: its first record {entries[0].name!r} is not in a folder, so torch "
            "cannot read it",
            path=path,
        )
    outside = [e.name for e in entries if not e.name.startswith(root + "/")]
    if outside:
        raise CorruptCheckpointError(
            f"{path!r}: records {', '.join(map(repr, outside[:3]))} lie outside the archive "
            f"folder {root!r}, which torch ignores; the archive is ambiguous",
            path=path,
        )
    return root


def _records(entries: list[ZipEntry], root: str) -> dict[str, ZipRecord]:
    return {
        e.name[len(root) + 1 :]: ZipRecord(
            name=e.name[len(root) + 1 :],
            data_offset=e.data_offset,
            size=e.file_size,
            crc32=e.crc32,
            compressed=e.compressed,
        )
        for e in entries
        if not e.name.endswith("/")
    }


def _check_torch_records(path: str, fd: int, entries: dict[str, ZipEntry]) -> None:
    """Refuse what torch's reader refuses: no data.pkl or version record, a foreign byte order."""
    listing = ", ".join(list(entries)[:5]) + (" ..." if len(entries) > 5 else "")
    for what, names in (("a data.pkl", ("data.pkl",)), ("a version", _VERSION_RECORDS)):
        if not any(n in entries for n in names):
            raise CorruptCheckpointError(
                f"{path!r} is a zip archive without {what} record, so it is not a torch "
                f"archive torch.load reads (records: {listing})",
                path=path,
            )
    order = entries.get("byteorder")
    if order is not None:
        value = read_entry(path, fd, order, _SMALL_RECORD)
        if value == b"big":
            raise UnsupportedFormatError(
                f"{path!r} was saved big-endian (torch.load byte-swaps it on loading); load "
                "it with torch.load and save it again",
                path=path,
            )
        if value != b"little":
            raise CorruptCheckpointError(
                f"{path!r}: its byteorder record is {value[:16]!r}, not little or big", path=path
            )


def open_torch_zip(path: str) -> Checkpoint:
    """Open a torch zip archive (``torch.save`` or ``torch.jit.save``) without loading tensors.

    Args:
        path: the archive.

    Returns:
        A :class:`Checkpoint` of format ``torch-zip`` or ``torchscript``.

    Raises:
        CorruptCheckpointError: not a valid torch archive, or truncated.
        ResourceLimitError: ``data.pkl`` is implausibly large.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        entries = read_zip_directory(path, fd, os.fstat(fd).st_size)
        root = _archive_root(entries, path)
        by_name = {e.name[len(root) + 1 :]: e for e in entries}
        _check_torch_records(path, fd, by_name)
        payload = read_entry(path, fd, by_name["data.pkl"], MAX_PICKLE_BYTES)
    finally:
        os.close(fd)
    records = _records(entries, root)
    fmt = "torchscript" if any(m in records for m in _TORCHSCRIPT_MARKERS) else "torch-zip"
    result = load_pickle(io.BytesIO(payload))

    for storage in result.storages.values():
        if storage.view is not None:
            # torch.load's zip reader unpacks exactly five fields and fails on a view's sixth;
            # reading on would place the view's tensors in its root storage's bytes.
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} is a legacy storage view, which a zip "
                "archive cannot hold (torch.load refuses it too)"
            )
        record = records.get(f"data/{storage.key}")
        if record is None:
            raise CorruptCheckpointError(
                f"{path!r}: the pickle refers to storage {storage.key!r} but the archive has no "
                f"record data/{storage.key}"
            )
        if record.size != storage.nbytes:
            # torch.load refuses both ways ("record size does not match expected size").
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} needs {storage.nbytes} bytes, its record "
                f"holds {record.size}",
                path=path,
            )

    def locate(storage: StorageRef) -> ByteSpan:
        record = records[f"data/{storage.key}"]
        if record.compressed:
            raise CorruptCheckpointError(
                f"{path!r}: record data/{storage.key} is compressed; torch writes storages "
                "stored, so this archive was re-zipped: re-save it with torch.save"
            )
        return ByteSpan(path, record.data_offset, storage.nbytes)

    return Checkpoint(
        path=path,
        format=fmt,
        root=result.root,
        storages=result.storages,
        unsafe_globals=result.unsafe_globals,
        protocol=result.protocol,
        records=records,
        archive_root=root,
        locate=locate,
    )
