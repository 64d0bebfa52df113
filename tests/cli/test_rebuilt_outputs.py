"""slim, extract and convert on a file of sparse, nested and meta tensors, on the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import helpers as h
from tests.helpers.builders import rebuilt_tensors


@pytest.mark.parametrize(
    "args",
    [
        ["slim", "--dtype", "fp16"],
        ["slim"],
        ["extract", "--prefix", "coo"],
        ["extract", "--prefix", "nested"],
    ],
)
def test_writes_sparse_and_nested_tensors(tmp_path: Path, args: list[str]) -> None:
    torch.save(rebuilt_tensors(), tmp_path / "in.pt")
    command, *options = args
    _, stdout, _ = h.run_ckpt(command, tmp_path / "in.pt", tmp_path / "out.pt", *options)
    assert "verified" in stdout
    assert torch.load(tmp_path / "out.pt", weights_only=True)


def test_convert_to_safetensors_names_the_tensors_and_the_fixes(tmp_path: Path) -> None:
    torch.save(rebuilt_tensors(), tmp_path / "in.pt")
    out = tmp_path / "out.safetensors"
    _, _, stderr = h.run_ckpt("convert", tmp_path / "in.pt", out, code=7)
    assert "6 tensors it cannot hold: coo (sparse_coo layout)" in stderr
    assert "non-tensor" not in stderr and "--drop-extras" in stderr and not out.exists()
