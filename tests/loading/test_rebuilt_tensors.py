"""Sparse, meta and nested tensors load as torch.load(weights_only=True) loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools import load_state_dict
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests.helpers.builders import rebuilt_tensors
from tests.helpers.committed import tools


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.layout != want.layout or got.device != want.device or got.dtype != want.dtype:
        return False
    if want.is_nested:
        return all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind(), strict=True))
    if want.is_meta:
        return got.shape == want.shape and got.stride() == want.stride()
    return torch.equal(got.to_dense(), want.to_dense())


def test_sparse_meta_and_nested_tensors_load_as_torch_loads_them(tmp_path: Path) -> None:
    path = tmp_path / "rebuilt.pt"
    torch.save(rebuilt_tensors(), path)
    want = torch.load(path, weights_only=True)
    got = load_state_dict(path)  # found as the state dict: they count as tensors
    assert list(got) == list(want)
    for name in want:
        assert _same(got[name], want[name]), name


def test_a_nested_tensor_past_its_buffer_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "nested.pt"
    torch.save({"nt": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])}, src)
    # The second component starts at element 7 instead of 6: its last one lies past the end.
    offsets = open_checkpoint(src).root["nt"].args[3].storage.key
    moved = torch.tensor([0, 7]).numpy().tobytes()
    bad = tmp_path / "bad.pt"
    tools().rewrite_zip(src, bad, replace={f"data/{offsets}": moved})
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        load_state_dict(bad)
