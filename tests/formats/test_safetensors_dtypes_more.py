"""The newer safetensors dtypes: FNUZ float8s and packed float4, read and written as it does."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
SafetensorError = pytest.importorskip("safetensors").SafetensorError

import ckpt_tools as ct  # noqa: E402
from ckpt_tools.errors import (  # noqa: E402
    ConversionError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _tensors() -> dict[str, torch.Tensor]:
    packed = torch.tensor([[0x12, 0x34, 0x9A], [0x56, 0x78, 0xBC]], dtype=torch.uint8)
    return {
        "e4m3fnuz": torch.arange(-3.0, 3.0, 0.5).to(torch.float8_e4m3fnuz),
        "e5m2fnuz": torch.arange(-3.0, 3.0, 0.5).reshape(3, 4).to(torch.float8_e5m2fnuz),
        "f4": packed.view(torch.float4_e2m1fn_x2),
        "f4_empty": torch.empty(0, 3, dtype=torch.float4_e2m1fn_x2),
        "f4_rows_empty": torch.empty(2, 0, dtype=torch.float4_e2m1fn_x2),
    }


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def _hand_made(path: Path, entry: dict, data: bytes) -> Path:
    raw = json.dumps({"x": entry}).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_reads_what_safetensors_writes(tmp_path: Path) -> None:
    src = tmp_path / "in.safetensors"
    safetensors_torch.save_file(_tensors(), str(src))
    oracle = safetensors_torch.load_file(str(src))
    ours = ct.load_state_dict(src, map_location="cpu")
    assert sorted(ours) == sorted(oracle)
    for name, want in oracle.items():
        got = ours[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert torch.equal(_bits(got), _bits(want)), name
    info = {t.name: t for t in ct.inspect(src).tensors}
    for name, want in oracle.items():
        assert info[name].dtype == str(want.dtype).removeprefix("torch.")
        assert tuple(info[name].shape) == tuple(want.shape)
        assert info[name].nbytes == want.numel() * want.element_size()


def test_writes_what_safetensors_reads(tmp_path: Path) -> None:
    tensors = _tensors()
    torch.save(tensors, tmp_path / "in.pt")
    ct.convert(tmp_path / "in.pt", tmp_path / "out.safetensors", verify="full")
    back = safetensors_torch.load_file(str(tmp_path / "out.safetensors"))
    for name, want in tensors.items():
        assert (back[name].dtype, back[name].shape) == (want.dtype, want.shape), name
        assert torch.equal(_bits(back[name]), _bits(want)), name
    safetensors_torch.save_file(tensors, str(tmp_path / "oracle.safetensors"))
    ours, theirs = _header(tmp_path / "out.safetensors"), _header(tmp_path / "oracle.safetensors")
    for name in tensors:
        assert ours[name]["dtype"] == theirs[name]["dtype"], name
        assert ours[name]["shape"] == theirs[name]["shape"], name


def test_safetensors_to_pt_and_back(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors_torch.save_file(tensors, str(tmp_path / "in.safetensors"))
    ct.convert(tmp_path / "in.safetensors", tmp_path / "mid.pt", verify="full")
    ct.convert(tmp_path / "mid.pt", tmp_path / "out.safetensors", verify="full")
    mid = torch.load(tmp_path / "mid.pt", weights_only=True)
    back = safetensors_torch.load_file(str(tmp_path / "out.safetensors"))
    for name, want in tensors.items():
        for got in (mid[name], back[name]):
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert torch.equal(_bits(got), _bits(want)), name


def test_a_0d_float4_is_refused_before_writing(tmp_path: Path) -> None:
    scalar = torch.tensor(0x12, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(SafetensorError):  # safetensors refuses it too
        safetensors_torch.save_file({"s": scalar}, str(tmp_path / "oracle.safetensors"))
    torch.save({"s": scalar}, tmp_path / "in.pt")
    with pytest.raises(ConversionError, match="float4_e2m1fn_x2"):
        ct.convert(tmp_path / "in.pt", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("tag", ["F6_E2M3", "F6_E3M2"])
def test_a_dtype_torch_lacks_is_unsupported_not_malformed(tmp_path: Path, tag: str) -> None:
    path = _hand_made(
        tmp_path / "f6.safetensors",
        {"dtype": tag, "shape": [4], "data_offsets": [0, 3]},
        b"\x01\x02\x03",
    )
    with pytest.raises(SafetensorError, match=tag):  # the oracle reads the header, loads nothing
        safetensors_torch.load_file(str(path))
    with pytest.raises(UnsupportedFormatError, match=tag) as caught:
        ct.inspect(path)
    assert "malformed" not in str(caught.value)


@pytest.mark.parametrize(
    ("shape", "nbytes", "error", "why"),
    [
        ([3], 2, CorruptCheckpointError, "no whole bytes"),  # 12 bits: the crate refuses
        ([], 1, CorruptCheckpointError, "no whole bytes"),  # one 4-bit element
        ([2, 3], 3, UnsupportedFormatError, "shape"),  # rows of 1.5 torch elements
        ([0, 3], 0, UnsupportedFormatError, "shape"),
    ],
)
def test_float4_shapes_safetensors_cannot_load(
    tmp_path: Path, shape: list[int], nbytes: int, error: type[Exception], why: str
) -> None:
    entry = {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}
    path = _hand_made(tmp_path / "f4.safetensors", entry, b"\x12" * nbytes)
    with pytest.raises(SafetensorError):
        safetensors_torch.load_file(str(path))
    with pytest.raises(error, match=f"'x'.*{why}"):
        ct.load_state_dict(path, map_location="cpu")
