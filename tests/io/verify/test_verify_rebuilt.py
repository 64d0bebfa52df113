"""verify_output on sparse, nested and meta tensors: checked and counted as tensors."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import VerificationError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.verify.outputs import Expected, verify_output
from tests.helpers.builders import rebuilt_tensors


def _saved(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.save(tensors, path)
    return path


def test_rebuilt_tensors_are_checked_and_counted(tmp_path: Path) -> None:
    src = open_checkpoint(_saved(tmp_path / "a.pt", rebuilt_tensors()))
    expected = Expected(dict(src.root), (), src, rebuilt=True)
    said = verify_output(src.path, expected, "full")
    assert said == "verified: 7 tensors, keys, sizes and bytes"


def test_a_plan_of_dense_tensors_leaves_them_unchecked(tmp_path: Path) -> None:
    src = open_checkpoint(_saved(tmp_path / "a.pt", rebuilt_tensors()))
    expected = Expected({"dense": src.root["dense"]}, (), src)
    assert verify_output(src.path, expected) == "verified: 1 tensors, keys and sizes"


@pytest.mark.parametrize(
    ("written", "says"),
    [
        ("csr", "'coo' reads back as sparse_csr float32 [4, 6], expected sparse_coo"),
        ("dense", "'coo' reads back as TensorRef, expected sparse_coo"),
    ],
)
def test_a_rebuilt_tensor_written_otherwise_is_refused(
    tmp_path: Path, written: str, says: str
) -> None:
    tensors = rebuilt_tensors()
    src = open_checkpoint(_saved(tmp_path / "a.pt", {"coo": tensors["coo"]}))
    out = _saved(tmp_path / "b.pt", {"coo": tensors[written]})
    with pytest.raises(VerificationError, match=says.replace("[", r"\[")):
        verify_output(str(out), Expected(dict(src.root), (), src, rebuilt=True))


def test_a_part_with_other_bytes_is_refused_at_full(tmp_path: Path) -> None:
    coo = rebuilt_tensors()["coo"]
    src = open_checkpoint(_saved(tmp_path / "a.pt", {"coo": coo}))
    out = _saved(tmp_path / "b.pt", {"coo": coo * 2})
    with pytest.raises(VerificationError, match=r"the bytes of 'coo' \(part 1\) differ"):
        verify_output(str(out), Expected(dict(src.root), (), src, rebuilt=True), "full")
