"""Reading torch zip archives (``torch.save`` since 1.6, and TorchScript archives).

Only the central directory, the local headers and ``data.pkl`` are read; storage records
are located, never loaded.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from pathlib import PurePosixPath

from ckpt_tools.descriptors import ByteSpan, StorageRef
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.formats.pickles import MAX_PICKLE_BYTES, load_pickle

__all__ = ["open_torch_zip"]

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
# Records a TorchScript archive has and a torch.save archive never has.
_TORCHSCRIPT_MARKERS = ("constants.pkl", "bytecode.pkl")


def _archive_root(names: list[str], path: str) -> str:
    roots = {str(PurePosixPath(n).parent) for n in names if PurePosixPath(n).name == "data.pkl"}
    top_level = [r for r in roots if "/" not in r and r != "."]
    if not top_level:
        raise CorruptCheckpointError(
            f"{path!r} is a zip archive without a data.pkl record, so it is not a torch "
            f"checkpoint (records: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''})"
        )
    if len(top_level) > 1:
        raise CorruptCheckpointError(
            f"{path!r} holds several torch archives ({', '.join(sorted(top_level))}); "
            "expected one root folder"
        )
    return top_level[0]


def _read_records(path: str, infos: list[zipfile.ZipInfo], root: str) -> dict[str, ZipRecord]:
    records: dict[str, ZipRecord] = {}
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for info in infos:
            if not info.filename.startswith(root + "/") or info.is_dir():
                continue
            encoded = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
            header = os.pread(fd, _LOCAL_HEADER.size + len(encoded), info.header_offset)
            if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_SIGNATURE:
                raise CorruptCheckpointError(
                    f"{path!r}: the local header of record {info.filename!r} is missing "
                    "(the file is truncated or not a valid zip)"
                )
            name_len, extra_len = _LOCAL_HEADER.unpack(header[: _LOCAL_HEADER.size])[-2:]
            if header[_LOCAL_HEADER.size :] != encoded or name_len != len(encoded):
                raise CorruptCheckpointError(
                    f"{path!r}: record {info.filename!r} is named differently in its local "
                    "header than in the directory (the archive is damaged)"
                )
            data_offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            if data_offset + info.compress_size > size:
                raise CorruptCheckpointError(
                    f"{path!r}: record {info.filename!r} needs {info.compress_size} bytes at "
                    f"offset {data_offset}, but the file ends at {size} (truncated download?)"
                )
            name = info.filename[len(root) + 1 :]
            records[name] = ZipRecord(
                name=name,
                data_offset=data_offset,
                size=info.file_size,
                crc32=info.CRC,
                compressed=info.compress_type != zipfile.ZIP_STORED,
            )
    finally:
        os.close(fd)
    return records


def _read_record(path: str, record: ZipRecord) -> bytes:
    # The directory is already parsed: one pread, checked against the record's CRC-32.
    if record.compressed:
        with zipfile.ZipFile(path) as archive:
            return archive.read(f"{_root_of(archive)}/{record.name}")
    with open(path, "rb") as f:
        payload = os.pread(f.fileno(), record.size, record.data_offset)
    if len(payload) != record.size or zlib.crc32(payload) != record.crc32:
        raise CorruptCheckpointError(
            f"{path!r}: record {record.name} fails its CRC-32 check (the file is damaged); "
            "download or copy it again"
        )
    return payload


def _root_of(archive: zipfile.ZipFile) -> str:
    return _archive_root(archive.namelist(), archive.filename or "")


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
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path!r} starts like a zip archive but its directory cannot be read ({e}); "
            "the file is probably truncated: download or copy it again"
        ) from e
    root = _archive_root([i.filename for i in infos], path)
    records = _read_records(path, infos, root)
    fmt = "torchscript" if any(m in records for m in _TORCHSCRIPT_MARKERS) else "torch-zip"

    data = records["data.pkl"]
    if data.size > MAX_PICKLE_BYTES:
        from ckpt_tools.errors import ResourceLimitError

        raise ResourceLimitError(
            f"{path!r}: data.pkl is {data.size} bytes, over the {MAX_PICKLE_BYTES >> 20} MiB limit"
        )
    payload = _read_record(path, data)
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
        if record.size < storage.nbytes:
            raise CorruptCheckpointError(
                f"{path!r}: storage {storage.key!r} needs {storage.nbytes} bytes, its record "
                f"holds {record.size}"
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
