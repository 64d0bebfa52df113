"""Rewrites (add-module, convert, sanitize) of sparse, nested and meta tensors: counts and
safetensors refusals, checked with torch.load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import NonTensorEntriesError
from ckpt_tools.formats import open_checkpoint
from tests.helpers.builders import rebuilt_tensors


def _source(path: Path) -> Path:
    torch.save(rebuilt_tensors(), path)
    return path


def _storage_bytes(path: Path) -> int:
    return sum(s.nbytes for s in open_checkpoint(path).storages.values())


def test_add_module_verifies_and_counts_every_tensor(tmp_path: Path) -> None:
    src = _source(tmp_path / "in.pt")
    result = ct.add_module(src, tmp_path / "out.pt", verify="full")
    assert result.verification == "verified: 7 tensors, keys, sizes and bytes"
    assert result.bytes_written == _storage_bytes(src)


def test_convert_to_safetensors_says_which_tensors_it_cannot_hold(tmp_path: Path) -> None:
    src = _source(tmp_path / "in.pt")
    with pytest.raises(NonTensorEntriesError) as caught:
        ct.convert(src, tmp_path / "out.safetensors")
    message = str(caught.value)
    assert "non-tensor" not in message
    assert "6 tensors it cannot hold" in message
    assert "meta (meta device)" in message and "nested (nested layout)" in message


def test_convert_to_safetensors_drop_extras_writes_the_dense_tensors(tmp_path: Path) -> None:
    src = _source(tmp_path / "in.pt")
    result = ct.convert(src, tmp_path / "out.safetensors", drop_extras=True)
    assert set(result.dropped) == {"coo", "csr", "csc", "bsr", "meta", "nested"}
    assert list(load_file(tmp_path / "out.safetensors")) == ["dense"]


def test_sanitize_counts_the_bytes_of_every_tensor(tmp_path: Path) -> None:
    src = _source(tmp_path / "in.pt")
    want = torch.load(src, weights_only=True)
    for verify in ("sizes", "full"):
        result = ct.sanitize(src, tmp_path / f"{verify}.pt", verify=verify)
        assert result.bytes_written == _storage_bytes(src)
        assert result.bytes_copied == _storage_bytes(src)
        assert result.tensors == len(want)
        assert result.verification.startswith(f"verified: {len(want)} tensors")


def test_sanitize_verifies_sparse_tensors_under_a_list_root(tmp_path: Path) -> None:
    dense = torch.arange(6.0).reshape(2, 3)
    src = tmp_path / "in.pt"
    torch.save([dense.to_sparse(), dense, torch.nested.nested_tensor([dense, dense[:1]])], src)
    for verify in ("sizes", "full"):
        result = ct.sanitize(src, tmp_path / f"{verify}.pt", verify=verify)
        assert result.verification.startswith("verified: 3 tensors"), result.verification
        got = torch.load(tmp_path / f"{verify}.pt", weights_only=True)
        assert torch.equal(got[0].to_dense(), dense) and torch.equal(got[1], dense)
        assert torch.equal(got[2][1], dense[:1])
