"""Header shapes whose sizes overflow: refused where safetensors or torch refuses them.

A shape with a 0 has no bytes, so the file does not bound its other dimensions; the crate
multiplies them in order with overflow checks, and torch keeps sizes and strides as int64.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import ckpt_tools as ct
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
SafetensorError = pytest.importorskip("safetensors").SafetensorError


def _hand_made(path: Path, dtype: str, shape: list[int], nbytes: int = 0) -> Path:
    entry = {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}
    raw = json.dumps({"big": entry}).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * nbytes)
    return path


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "why"),
    [
        ("F32", [2**32, 2**32, 0], 0, "past 64 bits"),  # past 64 bits before the 0
        ("U8", [2**62, 4, 0], 0, "past 64 bits"),
        ("F32", [2**62], 0, "past 64 bits"),  # the element count fits, the bit count not
        ("F64", [2**61], 8, "past 64 bits"),
        ("F32", [0, 2**64], 0, "malformed"),  # past u64: no integer to serde
    ],
)
def test_overflowing_sizes_are_corrupt(
    tmp_path: Path, dtype: str, shape: list[int], nbytes: int, why: str
) -> None:
    path = _hand_made(tmp_path / "in.safetensors", dtype, shape, nbytes)
    with pytest.raises(SafetensorError):
        safetensors_torch.load_file(str(path))
    with pytest.raises(CorruptCheckpointError, match=f"'big'.*{why}") as caught:
        ct.inspect(path)
    assert not isinstance(caught.value, UnsupportedFormatError)
    with pytest.raises(CorruptCheckpointError, match="'big'"):
        ct.convert(path, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize(
    "shape",
    [[2**63, 0], [2**64 - 1, 0], [0, 2**62, 2], [0, 3, 2**62]],
)
def test_sizes_torch_cannot_make_are_unsupported(tmp_path: Path, shape: list[int]) -> None:
    path = _hand_made(tmp_path / "in.safetensors", "F32", shape)
    with pytest.raises((SafetensorError, TypeError, RuntimeError)):
        safetensors_torch.load_file(str(path))
    with pytest.raises(UnsupportedFormatError, match="'big'"):
        ct.load_state_dict(path, map_location="cpu")


@pytest.mark.parametrize(
    ("dtype", "shape"),
    # The header's last dimension counts F4 elements; torch's, twice fewer, must fit int64.
    [("F4", [0, 2**63]), ("F4", [2**61, 4, 0]), ("F4", [2**62, 3, 0])],
)
def test_large_empty_shapes_that_load_still_read(
    tmp_path: Path, dtype: str, shape: list[int]
) -> None:
    path = _hand_made(tmp_path / "in.safetensors", dtype, shape)
    want = safetensors_torch.load_file(str(path))["big"]
    got = ct.load_state_dict(path, map_location="cpu")["big"]
    assert (got.dtype, got.shape) == (want.dtype, want.shape)
