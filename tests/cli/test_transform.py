"""``ckpt slim --dtype`` takes the spellings ``slim(dtype=)`` takes; outputs read with
``torch.load``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from tests.helpers import run_ckpt

SPELLINGS = {
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float16: ("fp16", "float16", "half"),
    torch.float32: ("fp32", "float32", "float"),
}


@pytest.mark.parametrize(
    ("spelling", "dtype"), [(s, d) for d, names in SPELLINGS.items() for s in names]
)
def test_slim_dtype_spellings_match_the_library(
    tmp_path: Path, spelling: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    sd = {"w": torch.randn(3, 3, dtype=torch.float64), "ids": torch.arange(3)}
    torch.save(sd, tmp_path / "in.pt")
    run_ckpt("slim", tmp_path / "in.pt", tmp_path / "cli.pt", "--dtype", spelling, "-q")
    ct.slim(tmp_path / "in.pt", tmp_path / "lib.pt", dtype=spelling)
    cli, lib = (torch.load(tmp_path / n, weights_only=True) for n in ("cli.pt", "lib.pt"))
    assert cli["w"].dtype == dtype and torch.equal(cli["w"], sd["w"].to(dtype))
    assert torch.equal(cli["w"], lib["w"]) and cli["ids"].dtype == torch.int64


def test_slim_unknown_dtype_lists_the_spellings(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "in.pt")
    res = run_ckpt("slim", tmp_path / "in.pt", tmp_path / "o.pt", "--dtype", "int8", code=2)
    assert "--dtype 'int8': expected one of: bf16, bfloat16, fp16, float16, half" in res.stderr
    assert not (tmp_path / "o.pt").exists()
