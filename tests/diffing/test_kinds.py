"""diff() on a key that holds a tensor on one side and another kind of entry on the other:
present on both sides (neither missing nor unexpected), status ``kind``, a difference."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from ckpt_tools.diffing.engine import diff
from tests.diffing.conftest import Save
from tests.helpers import run_ckpt


@pytest.mark.parametrize("other", ["text", 3, None, {"nested": 1}])
def test_a_tensor_against_another_entry_is_a_kind_difference(save: Save, other: Any) -> None:
    with_tensor = {"x": torch.ones(1), "y": torch.ones(2)}
    with_other = {"x": torch.ones(1), "y": other}
    a_path, b_path = save(with_tensor, "a.pt"), save(with_other, "b.pt")
    loaded = torch.load(b_path, weights_only=True)
    assert "y" in loaded and not isinstance(loaded["y"], torch.Tensor)
    kind = "None" if other is None else type(other).__name__
    for a, b, kinds in (
        (a_path, b_path, ("tensor", kind)),
        (b_path, a_path, (kind, "tensor")),
        (with_tensor, with_other, ("tensor", kind)),
    ):
        report = diff(a, b)
        assert report.missing == report.unexpected == ()
        assert not report.identical and report.found() == {"kind"}
        pair = report.tensor("y")
        assert pair.status == "kind" and (pair.kind_a, pair.kind_b) == kinds
        one, other = (("an " if k == "int" else "a ") + k for k in kinds)
        assert pair.note == f"{one} in A, {other} in B: not compared"
        assert report.tensor("x").status == "equal"


def test_fail_on_kind_and_any_exit_one(save: Save, capsys: Any) -> None:
    a_path = save({"x": torch.ones(1), "y": torch.ones(2)}, "a.pt")
    b_path = save({"x": torch.ones(1), "y": "text"}, "b.pt")
    code, out, _ = run_ckpt("diff", a_path, b_path, code=None)
    assert code == 0 and "unexpected" not in out
    assert "y       kind      float32 / str" in out
    assert "1 common key holds a tensor on one side only (kind)" in out
    for fail_on in ("kind", "any"):
        code, out, _ = run_ckpt("diff", a_path, b_path, "--json", "--fail-on", fail_on, code=None)
        report = json.loads(out)
        assert code == 1 and report["failed_on"] == ["kind"] and report["unexpected"] == []
        (pair,) = [t for t in report["tensors"] if t["name"] == "y"]
        assert pair["status"] == "kind" and pair["dtype"] == ["float32", "str"]
    assert run_ckpt("diff", a_path, b_path, "--fail-on", "value,shape", code=None)[0] == 0


def test_a_module_extra_state_against_a_tensor(save: Save) -> None:
    class WithState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def get_extra_state(self) -> Any:
            return "step 3"

        def set_extra_state(self, state: Any) -> None:
            pass

    path = save({"w": torch.ones(2), "_extra_state": torch.zeros(1)}, "a.pt")
    report = diff(path, WithState())
    assert report.missing == report.unexpected == () and report.found() == {"kind"}
    assert report.tensor("_extra_state").kind_b == "str"
