"""Big-endian torch zips (a byteorder record saying ``big``) load as torch.load loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools import load_state_dict
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.loading.tensor_io import iter_chunks, read_tensor
from tests.helpers.byteorder import big_endian_copy


def _every_width() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd = {
        "f32": torch.randn(3, 4),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(5).bfloat16(),
        "f64": torch.randn(2).double(),
        "i64": torch.arange(6),
        "i16": torch.arange(-3, 3, dtype=torch.int16),
        "c64": torch.randn(3, dtype=torch.complex64),
        "c128": torch.randn(2, dtype=torch.complex128),
        "bool": torch.tensor([True, False]),
        "u8": torch.arange(4, dtype=torch.uint8),
        "transposed": torch.randn(4, 3).t(),
    }
    sd["row"] = sd["f32"][1]  # a view into another tensor's storage
    return sd


@pytest.fixture
def big_endian(tmp_path: Path) -> Path:
    torch.save(_every_width(), tmp_path / "little.pt")
    return big_endian_copy(tmp_path / "little.pt", tmp_path / "big.pt")


def test_the_copy_is_big_endian_and_torch_loads_it_equal(big_endian: Path) -> None:
    assert open_checkpoint(big_endian).byteorder == "big"
    want = torch.load(big_endian, weights_only=True)
    for name, tensor in _every_width().items():
        assert torch.equal(want[name], tensor), name


@pytest.mark.parametrize("map_location", [None, "cpu"])
def test_a_big_endian_zip_loads_as_torch_loads_it(big_endian: Path, map_location: str) -> None:
    want = torch.load(big_endian, weights_only=True, map_location=map_location)
    got = load_state_dict(big_endian, map_location=map_location)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].stride() == want[name].stride(), name
        assert torch.equal(got[name], want[name]), name
    # Swapped once per storage: a view of a swapped storage is not swapped back.
    assert got["row"].untyped_storage().data_ptr() == got["f32"].untyped_storage().data_ptr()
    assert torch.equal(got["row"], got["f32"][1])


def test_a_big_endian_file_is_left_as_it_was(big_endian: Path) -> None:
    before = big_endian.read_bytes()
    load_state_dict(big_endian)["f32"].add_(1)  # a mapped storage is a private copy
    assert big_endian.read_bytes() == before


def test_value_reads_of_a_big_endian_zip_are_swapped_as_torch_swaps_them(
    big_endian: Path,
) -> None:
    want = torch.load(big_endian, weights_only=True)
    ckpt = open_checkpoint(big_endian)
    for name, ref in ckpt.root.items():
        assert torch.equal(read_tensor(ckpt, ref), want[name]), name
        chunks = list(iter_chunks(ckpt, ref, chunk_bytes=8))
        assert torch.equal(torch.cat(chunks), want[name].reshape(-1)), name
