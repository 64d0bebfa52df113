"""A cast of a view gives the bits torch's ``view.to(dtype)`` gives, NaNs included: torch's
kernel picks a NaN's bits by its place in the tensor it casts (from its first element), not
by its place in the storage."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct


def _nans(n: int, dtype: torch.dtype) -> torch.Tensor:
    """NaNs of both signs and varied payloads, so every way of casting them shows."""
    bits = {torch.float64: torch.int64, torch.float16: torch.int16}[dtype]
    base = torch.full((n,), float("nan"), dtype=dtype).view(bits)
    payload = torch.arange(n, dtype=bits) % 7
    signed = torch.where(torch.arange(n) % 3 == 0, -1, 1).to(bits)
    out = (base | payload).view(dtype)
    return torch.where(signed < 0, -out, out)


def _bits(t: torch.Tensor) -> list[int]:
    ints = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(ints).flatten().tolist()


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "head": lambda b: b[:10],
    "middle": lambda b: b[5:47],
    "split": lambda b: b[60:],
    "matrix": lambda b: b[20:62].view(6, 7),
}


@pytest.mark.parametrize("name", list(VIEWS))
@pytest.mark.parametrize(("src", "dst"), [(torch.float64, "bfloat16"), (torch.float16, "float32")])
def test_slim_casts_a_view_as_torch_casts_it(
    tmp_path: Path, name: str, src: torch.dtype, dst: str
) -> None:
    base = _nans(100, src)
    sd = {"view": VIEWS[name](base), "other": base[:60]}
    torch.save(sd, tmp_path / "in.pt")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype=dst, verify="full")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    want = {k: v.to(getattr(torch, dst)) for k, v in sd.items()}
    assert _bits(out["view"]) == _bits(want["view"])
    # A view apart from the first one on the storage keeps its own runs.
    if name == "split":
        assert _bits(out["other"]) == _bits(want["other"])
    assert out["view"].untyped_storage().data_ptr() == out["other"].untyped_storage().data_ptr()


def test_a_transposed_view_is_cast_in_memory_order(tmp_path: Path) -> None:
    base = _nans(100, torch.float64)
    sd = {"t": base[:40].view(5, 8).t()}
    torch.save(sd, tmp_path / "in.pt")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype="bfloat16")
    out = torch.load(tmp_path / "out.pt", weights_only=True)["t"]
    assert out.stride() == sd["t"].stride()
    assert _bits(out) == _bits(sd["t"].to(torch.bfloat16))


@pytest.mark.parametrize("name", ["head", "middle", "split"])
def test_torch_and_safetensors_outputs_agree_on_a_view(tmp_path: Path, name: str) -> None:
    base = _nans(100, torch.float64)
    sd = {"view": VIEWS[name](base)}
    torch.save(sd, tmp_path / "in.pt")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.pt", dtype="bfloat16")
    ct.slim(tmp_path / "in.pt", tmp_path / "out.safetensors", dtype="bfloat16")
    want = _bits(sd["view"].to(torch.bfloat16))
    assert _bits(torch.load(tmp_path / "out.pt", weights_only=True)["view"]) == want
    assert _bits(load_file(tmp_path / "out.safetensors")["view"]) == want


@pytest.mark.parametrize("whole", [True, False])
def test_a_weight_viewed_by_an_entry_a_safetensors_output_leaves_out_is_cast(
    tmp_path: Path, whole: bool
) -> None:
    # The view outside the state dict is not written, so it cannot hold the weight uncast.
    x = torch.randn(4, 3)
    outside = x if whole else x[0]
    ck = {"state_dict": {"w": x, "b": torch.randn(3)}, "ema": {"w0": outside}, "epoch": 3}
    torch.save(ck, tmp_path / "in.pt")
    out = tmp_path / "out.safetensors"
    result = ct.slim(tmp_path / "in.pt", out, dtype="bf16", drop_extras=True)
    got = load_file(out)
    assert {k: v.dtype for k, v in got.items()} == {"w": torch.bfloat16, "b": torch.bfloat16}
    assert torch.equal(got["w"], x.to(torch.bfloat16))
    assert not [n for n in result.notes if "not cast" in n]
