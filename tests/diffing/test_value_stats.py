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
