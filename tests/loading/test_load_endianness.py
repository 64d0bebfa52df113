"""A torch zip without a byteorder record loads in torch's default load endianness."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.serialization import (
    LoadEndianness,
    get_default_load_endianness,
    set_default_load_endianness,
)

from ckpt_tools import load_state_dict


@pytest.fixture
def unrecorded(tmp_path: Path) -> Path:
    sd = {
        "i32": torch.arange(4, dtype=torch.int32),
        "f64": torch.linspace(0, 1, 3, dtype=torch.float64),
        "u8": torch.arange(3, dtype=torch.uint8),
    }
    torch.save(sd, tmp_path / "recorded.pt")
    path = tmp_path / "no_byteorder.pt"
    # As torch < 2.1 saved: the same records but the byteorder one.
    with zipfile.ZipFile(tmp_path / "recorded.pt") as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/byteorder"):
                dst.writestr(info, src.read(info))
    return path


@pytest.fixture
def restore_default() -> Iterator[None]:
    before = get_default_load_endianness()
    yield
    set_default_load_endianness(before)


def _assert_as_torch(path: Path, mmap: bool) -> None:
    ref = torch.load(path, weights_only=True, mmap=mmap)
    ours = load_state_dict(path, map_location="cpu", mmap=mmap)
    assert list(ours) == list(ref)
    for key, tensor in ref.items():
        assert torch.equal(ours[key], tensor), key


@pytest.mark.parametrize("mmap", [False, True], ids=["read", "mmap"])
def test_big_default_swaps_an_unrecorded_zip(
    unrecorded: Path, restore_default: None, mmap: bool
) -> None:
    set_default_load_endianness(LoadEndianness.BIG)
    _assert_as_torch(unrecorded, mmap)


def test_every_default_reads_as_torch_reads(unrecorded: Path, restore_default: None) -> None:
    for setting in (LoadEndianness.BIG, LoadEndianness.NATIVE, LoadEndianness.LITTLE, None):
        set_default_load_endianness(setting)
        _assert_as_torch(unrecorded, mmap=False)
