"""diff()'s tolerances: anything but a finite real number >= 0 is a UsageError naming it."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import ckpt_tools
from ckpt_tools.diffing.tolerances import check_tolerances
from ckpt_tools.errors import UsageError

A, B = {"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0005])}


@pytest.mark.parametrize("name", ["rtol", "atol"])
@pytest.mark.parametrize(
    ("value", "said", "got"),
    [
        ("1e-3", "'1e-3'", ", got str"),
        (None, "None", ", got NoneType"),
        (True, "True", ", got bool"),
        (torch.tensor(1e-3), "tensor(0.0010)", ", got Tensor"),
        (10**400, "<int of 1329 bits>", ", got an int too large for a float"),
    ],
    ids=["str", "None", "bool", "tensor", "huge-int"],
)
def test_a_tolerance_that_is_not_a_real_number_is_a_usage_error_naming_it(
    name: str, value: object, said: str, got: str
) -> None:
    with pytest.raises(UsageError) as info:
        ckpt_tools.diff(A, B, **{name: value})
    assert str(info.value) == f"{name}={said}: tolerances must be finite numbers >= 0{got}"
    assert (info.value.argument, info.value.value) == (name, said)
    assert isinstance(info.value, ValueError)  # the built-in parent, as for any UsageError


@pytest.mark.parametrize("value", [0, 1, Fraction(1, 1000), np.float32(1e-3), np.int64(0)])
def test_ints_fractions_and_numpy_numbers_are_tolerances_as_floats(value: object) -> None:
    rtol, atol = check_tolerances(value, value)
    assert type(rtol) is float and rtol == float(value) == atol  # type: ignore[arg-type]
    row = ckpt_tools.diff(A, B, rtol=0.0, atol=value).tensor("w")
    assert row.allclose is (float(value) >= 5e-4)  # type: ignore[arg-type]
