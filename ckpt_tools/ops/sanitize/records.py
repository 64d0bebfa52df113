"""The zip records a sanitized file keeps: only those ``torch.save`` writes.

A rewrite copies every record of a torch zip it does not parse, since torch.load never reads
them. Sanitize promises a file that names nothing outside the allowlist, so a record
torch.save never writes (a pickle added beside ``data.pkl``, a storage record no tensor
names) is left out and listed as dropped instead: a scanner or a later loader may read it.
"""

from __future__ import annotations

from dataclasses import replace

from ckpt_tools.formats.base import Checkpoint, ZipRecord
from ckpt_tools.io.tensor_bytes import decompressed
from ckpt_tools.io.writers.zipfile import PARSED_RECORDS
from ckpt_tools.ops.sanitize.result import Change

__all__ = ["torch_save_records"]

_SERIALIZATION_ID = ".data/serialization_id"
# torch's writer states the id as 20 decimal digits; more than this is no id of its.
_ID_MAX = 64


def torch_save_records(ckpt: Checkpoint) -> tuple[Checkpoint, tuple[Change, ...]]:
    """``ckpt`` with only the records torch.save writes, and a drop for each other one.

    Kept: ``data.pkl``, the bookkeeping records torch parses (the writer writes them as
    torch.save does), ``data/<key>`` for each storage the pickle names, and a
    ``.data/serialization_id`` that is decimal digits, as torch writes it.

    Args:
        ckpt: the opened input; a checkpoint that is no zip has no records and is returned
            as it is.

    Returns:
        The checkpoint the output is written from, and one :class:`Change` per record left
        out, its path the record's name in the archive.

    Raises:
        OSError: a compressed serialization id cannot be read.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> kept, dropped = torch_save_records(open_checkpoint("model.pt"))
        >>> dropped
        ()
    """
    storages = {f"data/{key}" for key in ckpt.storages}
    kept: dict[str, ZipRecord] = {}
    dropped = []
    for name, record in ckpt.records.items():
        if name == _SERIALIZATION_ID:
            keep = _plain_id(ckpt, record)
        else:
            keep = name == "data.pkl" or name in PARSED_RECORDS or name in storages
        if keep:
            kept[name] = record
            continue
        was = (
            "storage record no tensor names"
            if name.startswith("data/")
            else "zip record torch.save never writes"
        )
        dropped.append(Change(f"{ckpt.archive_root}/{name}", was, "dropped"))
    if not dropped:
        return ckpt, ()
    return replace(ckpt, records=kept), tuple(dropped)


def _plain_id(ckpt: Checkpoint, record: ZipRecord) -> bool:
    """Whether the serialization id holds what torch writes there: decimal digits only.

    The reader checks only that it is UTF-8, which a protocol 0 pickle is too.
    """
    if record.size > _ID_MAX:
        return False
    if record.compressed:
        with decompressed(ckpt, record.name) as chunks:
            value = b"".join(chunks)
    else:
        with open(ckpt.path, "rb") as f:
            f.seek(record.data_offset)
            value = f.read(record.size)
    return value.isdigit()
