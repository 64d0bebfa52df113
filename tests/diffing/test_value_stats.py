"""value_stats: ``max_rel`` where B is 0, on the path for chunks that hold NaN or infinity,
``max_abs`` of finite values whose gap float32 cannot hold, and of complex values whose
infinite parts agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ckpt_tools.diffing.engine import diff
from ckpt_tools.diffing.table import DIFF_COLUMNS, diff_rows
from ckpt_tools.diffing.value_stats import compare_tensors
from tests.helpers import run_ckpt

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ([INF, 1.0], [0.0, 1.0]),  # A infinite where B is 0
        ([-INF, 1.0], [0.0, 1.0]),
        ([2.0, NAN], [0.0, NAN]),  # finite A over a 0, in a chunk that holds a NaN
        ([2.0, INF], [0.0, INF]),
    ],
)
def test_max_rel_is_inf_where_b_is_zero_and_a_is_not_even_beside_nan_or_inf(
    a: list[float], b: list[float], dtype: torch.dtype
) -> None:
    ta, tb = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
    assert compare_tensors(ta, tb).max_rel == INF  # not torch.finfo(dtype).max
    row = diff({"x": ta}, {"x": tb}).tensor("x")
    assert row.max_rel == INF and row.to_json()["max_rel"] == "inf"
    assert row.status == "differ" and row.mismatched == 1


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize(
    ("a", "b", "gap"),
    [
        (complex(INF, 0), complex(INF, 1), 1.0),  # the same infinite real part
        (complex(2, -INF), complex(5, -INF), 3.0),
        (complex(INF, 0), complex(-INF, 0), INF),
        (complex(INF, 1), complex(INF, 1), 0.0),
    ],
)
def test_complex_values_whose_infinite_parts_agree_are_as_far_as_the_other_parts(
    a: complex, b: complex, gap: float, dtype: torch.dtype
) -> None:
    ta, tb = torch.tensor([a, 1], dtype=dtype), torch.tensor([b, 1], dtype=dtype)
    stats = compare_tensors(ta, tb)
    assert stats.max_abs == gap  # torch's own |a - b| is NaN here, and was shown as 0
    # Mismatches are torch.isclose's.
    assert stats.mismatched == int((~torch.isclose(ta, tb, equal_nan=True)).sum())


def test_the_table_shows_inf_for_an_infinite_max_rel(tmp_path: Path) -> None:
    torch.save({"x": torch.tensor([1.0, INF])}, tmp_path / "a.pt")
    torch.save({"x": torch.tensor([1.0, 0.0])}, tmp_path / "b.pt")
    report = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    row = dict(zip(DIFF_COLUMNS, diff_rows(report.tensors, group=True)[0]))
    assert (row["max abs"], row["max rel"], row["inf A/B"]) == ("inf", "inf", "1/0")

    printed = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt").stdout
    (line,) = [line for line in printed.splitlines() if line.startswith("x ")]
    assert line.split()[4:6] == ["inf", "inf"], printed
    printed = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json").stdout
    assert json.loads(printed)["tensors"][0]["max_rel"] == "inf"


@pytest.mark.parametrize("other", [2.0, NAN, INF])  # the finite path, and the one beside NaN/inf
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_max_abs_of_finite_values_past_float32s_range_is_their_real_gap(
    other: float, dtype: torch.dtype
) -> None:
    big = float(torch.finfo(torch.float32).max)
    ta = torch.tensor([big, other], dtype=dtype)
    tb = torch.tensor([-big, other], dtype=dtype)
    stats = compare_tensors(ta, tb)
    assert stats.max_abs == 2 * big  # Python's float64, not float32's inf
    assert stats.mismatched == 1 and not stats.allclose
    assert diff({"x": ta}, {"x": tb}).tensor("x").max_abs == 2 * big


def _pair(tmp_path: Path, a: torch.Tensor, b: torch.Tensor) -> tuple[Path, Path]:
    torch.save({"t": a}, tmp_path / "a.pt")
    torch.save({"t": b}, tmp_path / "b.pt")
    return tmp_path / "a.pt", tmp_path / "b.pt"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize(
    ("a", "b", "close"),
    [
        # A cast to e8m0 rounds to powers of two: [1, 3, -5, 0.1] -> [1, 4, 4, 0.125].
        (torch.tensor([1.0, 3.0, -5.0, 0.1]), "float8_e8m0fnu", False),
        (torch.tensor([1.0, 4.0, 0.125]), "float8_e8m0fnu", True),
        (torch.tensor([1 + 1j, 2 + 2j]), torch.tensor([9 + 9j, 7 - 7j]).to(torch.complex32), False),
        (torch.tensor([1 + 1j, 2 + 2j]), "complex32", True),
    ],
    ids=["e8m0-changed", "e8m0-exact", "complex32-other", "complex32-cast"],
)
def test_a_cast_to_e8m0_or_complex32_is_compared_by_value(
    tmp_path: Path, a: torch.Tensor, b: torch.Tensor | str, close: bool
) -> None:
    b = a.to(getattr(torch, b)) if isinstance(b, str) else b
    oracle = torch.allclose(
        a.to(torch.complex64 if a.is_complex() else torch.float32),
        b.to(torch.complex64 if b.is_complex() else torch.float32),
    )
    assert oracle == close
    (pair,) = diff(*_pair(tmp_path, a, b)).tensors
    assert pair.status == "dtype" and pair.allclose is close
    run_ckpt("diff", *_pair(tmp_path, a, b), "--fail-on", "value", code=0 if close else 1)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_pairs_are_close_as_torch_allclose_says(tmp_path: Path) -> None:
    a = torch.tensor([1 + 1j]).to(torch.complex32)
    b = torch.tensor([1.001 + 1j]).to(torch.complex32)
    assert torch.allclose(a, b, rtol=0.1)
    (pair,) = diff(*_pair(tmp_path, a, b), rtol=0.1).tensors
    assert pair.status == "close"


def test_a_pair_whose_values_cannot_be_compared_is_not_vouched_for(tmp_path: Path) -> None:
    # Packed float4 holds two values a byte: no number to compare with the float's.
    packed = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    files = _pair(tmp_path, torch.zeros(4), packed)
    (pair,) = diff(*files).tensors
    assert pair.status == "dtype" and pair.allclose is None and pair.values_differ
    run_ckpt("diff", *files, "--fail-on", "value", code=1)
