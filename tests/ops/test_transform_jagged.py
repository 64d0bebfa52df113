"""Jagged nested tensors through the file -> file operations: copied as torch.load reads
them, and left uncast (with a note) by a cast."""

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


def test_a_cast_keeps_jagged_tensors_with_a_note(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    torch.save(_state_dict(), src)
    want = torch.load(src, weights_only=True)
    result = ct.slim(src, tmp_path / "half.pt", dtype="float16")
    got = torch.load(tmp_path / "half.pt", weights_only=True)
    assert got["a.w"].dtype == torch.float16
    assert _same(got["a.n"], want["a.n"]) and _same(got["a.l"], want["a.l"])
    assert "jagged tensor 'a.n' kept as float32: its values are not cast" in result.notes
