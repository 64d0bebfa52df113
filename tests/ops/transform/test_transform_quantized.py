"""slim, extract and average of per-channel quantized tensors: their scales and zero points
are storages of their own, copied with the tensor, as torch.load reads them back."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools import ConversionError
from ckpt_tools.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _per_channel(x: torch.Tensor, scales: list[float], axis: int = 0) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(
            x,
            torch.tensor(scales, dtype=torch.float64),
            torch.arange(len(scales)),
            axis,
            torch.quint8,
        )


def _state(seed: int = 0, scales: tuple[float, ...] = (0.1, 0.2, 0.3)) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": _per_channel(torch.randn(3, 4, generator=gen), list(scales)),
        "enc.q": _per_channel(torch.randn(2, 3, generator=gen), [0.5, 0.25, 0.125], axis=1),
        "enc.w": torch.randn(2, generator=gen),
    }


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.qscheme() == want.qscheme()
    assert torch.equal(got, want)
    assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales())
    assert torch.equal(got.q_per_channel_zero_points(), want.q_per_channel_zero_points())
    assert got.q_per_channel_axis() == want.q_per_channel_axis()


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_slim_copies_per_channel_quantized_tensors(tmp_path: Path, dtype: str | None) -> None:
    sd = _state()
    torch.save(sd, tmp_path / "in.pt")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype=dtype, verify="full")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_same(out["q"], sd["q"])
    _assert_same(out["enc.q"], sd["enc.q"])
    assert torch.equal(out["enc.w"], sd["enc.w"].to(dtype and getattr(torch, dtype)))


def test_extract_keeps_the_quantizer_of_a_per_channel_tensor(tmp_path: Path) -> None:
    sd = _state()
    torch.save(sd, tmp_path / "in.pt")
    ct.extract(tmp_path / "in.pt", tmp_path / "out.pt", prefix="enc", strip_prefix=True)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == ["q", "w"]
    _assert_same(out["q"], sd["enc.q"])


def test_the_cli_slims_a_per_channel_tensor(tmp_path: Path) -> None:
    sd = _state()
    torch.save(sd, tmp_path / "in.pt")
    assert main(["slim", str(tmp_path / "in.pt"), str(tmp_path / "out.pt"), "-q"]) == 0
    _assert_same(torch.load(tmp_path / "out.pt", weights_only=True)["q"], sd["q"])


def test_average_copies_equal_per_channel_tensors_and_refuses_different(tmp_path: Path) -> None:
    a, b = _state(), _state()
    b["enc.w"] = b["enc.w"] + 1
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    ct.average([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_same(out["q"], a["q"])
    _assert_same(out["enc.q"], a["enc.q"])
    torch.save(_state(scales=(0.1, 0.2, 0.4)), tmp_path / "c.pt")
    with pytest.raises(ConversionError, match=r"q \(quint8\)"):
        ct.average([tmp_path / "a.pt", tmp_path / "c.pt"], tmp_path / "out2.pt")


def test_a_key_on_the_scales_storage_is_kept_with_them(tmp_path: Path) -> None:
    q = _per_channel(torch.randn(3, 4), [0.1, 0.2, 0.3])
    sd = {
        "q": q,
        "p": torch.nn.Parameter(q, requires_grad=False),
        "scales": q.q_per_channel_scales(),
        "f": torch.randn(3, dtype=torch.float64),
    }
    torch.save(sd, tmp_path / "in.pt")
    result = ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype="bfloat16", verify="full")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_same(out["q"], q)
    _assert_same(out["p"], q)
    assert torch.equal(out["scales"], sd["scales"])  # its storage is the quantizer's too
    assert torch.equal(out["f"], sd["f"].to(torch.bfloat16))
    assert any("kept as float64" in note for note in result.notes)
