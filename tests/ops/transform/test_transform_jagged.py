"""Jagged nested tensors through the file -> file operations: copied as torch.load reads
them, and cast as torch's ``.to(dtype)`` casts them (their values; offsets keep theirs)."""

from __future__ import annotations

from pathlib import Path

import torch

import ckpt_tools as ct


def _state_dict() -> dict[str, torch.Tensor]:
    values = torch.arange(16.0).reshape(8, 2)
    offsets = torch.tensor([0, 3, 8])
    return {
        "a.w": torch.ones(3),
        "a.n": torch.nested.nested_tensor_from_jagged(values, offsets),
        "a.l": torch.nested.nested_tensor_from_jagged(values, offsets, torch.tensor([2, 4])),
    }


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.is_nested != want.is_nested or got.dtype != want.dtype:
        return False
    if not want.is_nested:
        return torch.equal(got, want)
    return got.layout == want.layout and all(
        torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind(), strict=True)
    )


def test_extract_and_sanitize_copy_jagged_tensors_as_torch_loads_them(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save(_state_dict(), src)
    want = torch.load(src, weights_only=True)
    ct.extract(src, tmp_path / "x.pt", prefix="a.", strip_prefix=True)
    got = torch.load(tmp_path / "x.pt", weights_only=True)
    assert {k: _same(got[k.removeprefix("a.")], v) for k, v in want.items()} == dict.fromkeys(
        want, True
    )
    ct.sanitize(src, tmp_path / "s.pt")
    got = torch.load(tmp_path / "s.pt", weights_only=True)
    assert {k: _same(got[k], v) for k, v in want.items()} == dict.fromkeys(want, True)


def test_a_cast_casts_jagged_values_as_torch_to_does(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    sd = _state_dict()
    # A Parameter, a second ragged dimension, and values shared with a dense entry.
    sd["a.p"] = torch.nn.Parameter(sd["a.n"].detach().clone())
    sd["a.d"] = torch.nested.nested_tensor_from_jagged(
        torch.arange(24.0).reshape(2, 6, 2), torch.tensor([0, 2, 6]), jagged_dim=2
    )
    values = torch.arange(6.0).reshape(3, 2)
    sd["a.v"], sd["a.s"] = (
        values,
        torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3])),
    )
    torch.save(sd, src)
    want = {k: v.to(torch.float16) for k, v in torch.load(src, weights_only=True).items()}

    result = ct.slim(src, tmp_path / "half.pt", dtype="float16")
    got = torch.load(tmp_path / "half.pt", weights_only=True)
    assert {k: _same(got[k], v) for k, v in want.items()} == dict.fromkeys(want, True)
    for name in ("a.n", "a.l", "a.p", "a.d", "a.s"):
        assert got[name].offsets().dtype == torch.int64
        assert got[name]._ragged_idx == want[name]._ragged_idx
    assert isinstance(got["a.p"], torch.nn.Parameter) and got["a.p"].requires_grad
    # One storage cast once: the tensors that shared their values still do.
    assert got["a.n"].values().data_ptr() == got["a.l"].values().data_ptr()
    assert got["a.s"].values().data_ptr() == got["a.v"].data_ptr()
    assert not [n for n in result.notes if "jagged" in n]


def test_a_jagged_tensor_whose_values_a_kept_key_shares_keeps_its_dtype(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    values = torch.arange(6.0).reshape(3, 2)
    torch.save(
        {"v": values, "n": torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3]))},
        src,
    )
    result = ct.slim(src, tmp_path / "half.pt", dtype="float16", keep_dtype=[r"^v$"])
    got = torch.load(tmp_path / "half.pt", weights_only=True)
    assert got["v"].dtype == got["n"].dtype == torch.float32
    assert any("kept as float32" in n for n in result.notes), result.notes
