"""The multi-disk fields of a zip's end records, checked as torch checks them.

torch.save writes a zip64 end record, its locator and a classic end record, each with disk
numbers and counts that only matter to archives split over several disks. torch's reader
(miniz) refuses several of their values as "unsupported multidisk archive"; every field is
mutated here, and torch is the oracle: what it refuses we refuse (exit 4), what it reads we
read the same or refuse.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import EXIT_CORRUPT, CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests.helpers import console_script

# (record signature, field offset inside the record, struct format) of each disk field.
FIELDS = {
    "eocd.this_disk": (b"PK\x05\x06", 4, "<H"),
    "eocd.directory_disk": (b"PK\x05\x06", 6, "<H"),
    "eocd.records_on_disk": (b"PK\x05\x06", 8, "<H"),
    "locator.directory_disk": (b"PK\x06\x07", 4, "<L"),
    "locator.total_disks": (b"PK\x06\x07", 16, "<L"),
    "zip64.record_size": (b"PK\x06\x06", 4, "<Q"),
    "zip64.this_disk": (b"PK\x06\x06", 16, "<L"),
    "zip64.directory_disk": (b"PK\x06\x06", 20, "<L"),
    "zip64.records_on_disk": (b"PK\x06\x06", 24, "<Q"),
}
VALUES = (0, 1, 2, 65)


def _mutated(tmp_path: Path, field: str, value: int) -> Path:
    path = tmp_path / "good.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32), "b": torch.ones(2)}, path)
    data = bytearray(path.read_bytes())
    signature, offset, fmt = FIELDS[field]
    at = data.rfind(signature) + offset
    struct.pack_into(fmt, data, at, value)
    out = tmp_path / "mutated.pt"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("field", FIELDS)
def test_disk_fields_are_read_as_torch_reads_them(tmp_path: Path, field: str, value: int) -> None:
    path = _mutated(tmp_path, field, value)  # some values are what torch.save writes
    try:
        theirs = torch.load(path, weights_only=True)
    except RuntimeError:
        theirs = None
    try:
        ours = open_checkpoint(path)
    except CorruptCheckpointError:
        return  # refusing is always allowed
    assert theirs is not None, f"torch refuses {field}={value}, we read it"
    assert sorted(ours.root) == sorted(theirs)


def test_a_locator_declaring_many_disks_is_refused_like_torch(tmp_path: Path) -> None:
    path = _mutated(tmp_path, "locator.total_disks", 65)
    with pytest.raises(RuntimeError, match="multidisk"):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="65 disks"):
        open_checkpoint(path)
    run = subprocess.run(
        [console_script(), "inspect", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == EXIT_CORRUPT
    assert run.stderr.count("\n") == 1 and "several disks" in run.stderr
