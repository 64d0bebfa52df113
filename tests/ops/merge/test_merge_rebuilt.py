"""merge-lora on a base that also holds sparse, nested and meta tensors: copied as they are."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import ckpt_tools as ct
from tests import helpers as h
from tests.helpers.builders import rebuilt_tensors
from tests.helpers.lora import write_tiny_adapter


def test_merge_lora_copies_the_base_sparse_and_nested_tensors(tmp_path: Path) -> None:
    extra = {f"extra_{k}": v for k, v in rebuilt_tensors().items()}
    base = torch.load(h.FIXTURES / "plain.pt", weights_only=True)
    torch.save({**base, **extra}, tmp_path / "base.pt")
    lora = write_tiny_adapter(tmp_path / "lora")
    ct.merge_lora(tmp_path / "base.pt", lora, tmp_path / "out.pt", verify="full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = torch.load(tmp_path / "out.pt", weights_only=True)
        want = torch.load(tmp_path / "base.pt", weights_only=True)
    for key in ("extra_coo", "extra_csr", "extra_bsr"):
        assert got[key].layout == want[key].layout
        assert torch.equal(got[key].to_dense(), want[key].to_dense())
    assert torch.equal(got["extra_nested"].values(), want["extra_nested"].values())
    assert got["extra_meta"].device.type == "meta"
