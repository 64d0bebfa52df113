"""Where torch computes a storage record to lie under ``.format_version`` 1, and the check of
a layout against it. Oracles: torch's own ``get_record_offset_no_read`` and ``torch.save``."""

from __future__ import annotations

import itertools
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools.formats.zip.storage_offsets import (
    StorageRecord,
    _computed_data_offset,
    first_misplaced,
    in_key_order,
)

_U32 = 0xFFFFFFFF


def test_the_computed_offset_is_torchs_at_every_zip64_edge(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "m.pt")
    with open(tmp_path / "m.pt", "rb") as f:
        reader = torch._C.PyTorchFileReader(f)
        cursors = (0, 1, 100, 4095, _U32 - 100, _U32, _U32 + 7, 5 << 32)
        sizes = (0, 4, _U32 - 1, _U32, 1 << 33)
        for cursor, size, key, alignment in itertools.product(
            cursors, sizes, ("0", "123"), (1, 64, 4096)
        ):
            name = f"data/{key}"
            want = reader.get_record_offset_no_read(cursor, name, size, alignment)
            assert _computed_data_offset(cursor, len(f"m/{name}"), size, alignment) == want


def _records(path: Path) -> list[StorageRecord]:
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if "/data/" in i.filename]
    raw = path.read_bytes()
    records = []
    for info in infos:
        name_length = int.from_bytes(
            raw[info.header_offset + 26 : info.header_offset + 28], "little"
        )
        extra = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
        data = info.header_offset + 30 + name_length + extra
        key = info.filename.rsplit("/", 1)[1]
        records.append(StorageRecord(key, name_length, info.header_offset, data, info.file_size))
    return records


@pytest.mark.parametrize("alignment", [64, 4096])
def test_torch_save_layouts_hold_and_a_moved_record_does_not(
    tmp_path: Path, alignment: int
) -> None:
    from torch.utils.serialization import config

    sd = {f"w{i}": torch.randn(n) for i, n in enumerate((3, 0, 1000, 1, 70_000))}
    with config.patch({"save.storage_alignment": alignment}):
        torch.save(sd, tmp_path / "m.pt")
    records = in_key_order(_records(tmp_path / "m.pt"))
    assert [r.key for r in records] == ["0", "1", "2", "3", "4"]
    assert all(r.data_offset % alignment == 0 for r in records)
    assert first_misplaced(records, alignment) is None
    moved = records[3]._replace(data_offset=records[3].data_offset + alignment)
    assert first_misplaced([*records[:3], moved, *records[4:]], alignment) == "3"
    assert first_misplaced(records[1:], alignment) == "1"  # torch asserts "0" comes first
