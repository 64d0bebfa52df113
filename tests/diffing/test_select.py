"""diff()'s selections: ``select`` for A, as everywhere else, and ``select_b`` for B."""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
from torch import nn

import ckpt_tools
from ckpt_tools.errors import SelectError, UsageError
from tests.helpers import FIXTURES


@pytest.fixture
def ema(tmp_path: Path) -> Path:
    """A timm checkpoint: ``state_dict`` and ``state_dict_ema``, the latter chosen only when
    selected."""
    return Path(shutil.copy(FIXTURES / "state_dict_ema.pt", tmp_path / "timm.pth"))


def test_select_picks_a_state_dict_of_a_and_select_b_one_of_b(ema: Path) -> None:
    plain = FIXTURES / "plain.pt"
    report = ckpt_tools.diff(ema, plain, select="state_dict_ema")
    assert report.a.selected == ("state_dict_ema",) and report.b.selected == ()
    report = ckpt_tools.diff(plain, ema, select_b="state_dict_ema")
    assert report.b.selected == ("state_dict_ema",) and report.a.selected == ()


def test_diff_takes_select_as_inspect_and_load_state_dict_do() -> None:
    def selections(function: object) -> list[str]:
        options = inspect.signature(function).parameters  # type: ignore[arg-type]
        return [name for name in options if name.startswith("select")]

    assert selections(ckpt_tools.inspect) == selections(ckpt_tools.load_state_dict) == ["select"]
    assert selections(ckpt_tools.diff) == ["select", "select_b"]


@pytest.mark.parametrize(("argument", "flag"), [("select", "--select"), ("select_b", "--select-b")])
def test_a_selection_naming_no_entry_names_the_side_s_own_argument(
    ema: Path, argument: str, flag: str
) -> None:
    with pytest.raises(SelectError) as info:
        ckpt_tools.diff(ema, ema, **{argument: "nope"})
    assert str(info.value).startswith(f"{argument}='nope': no entry 'nope'")
    assert (info.value.argument, info.value.flag) == (argument, flag)


@pytest.mark.parametrize(("argument", "flag"), [("select", "--select"), ("select_b", "--select-b")])
def test_a_selection_for_a_module_side_names_that_side_s_argument(argument: str, flag: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(UsageError, match=rf"^{argument}='x': applies to checkpoints") as info:
        ckpt_tools.diff(model, model, **{argument: "x"})
    assert (info.value.argument, info.value.flag) == (argument, flag)


def test_what_the_choice_passed_over_is_said_not_called_identical(tmp_path: Path) -> None:
    # Two tensor dicts (a GAN's): the largest is compared, the other is named, uncompared.
    import torch

    from tests.helpers import run_ckpt

    enc = {"l1.weight": torch.ones(4, 4), "l1.bias": torch.ones(4), "l2.weight": torch.ones(4)}
    torch.save({"encoder": enc, "decoder": {"out.weight": torch.ones(2)}}, tmp_path / "a.pt")
    torch.save({"encoder": enc, "decoder": {"out.weight": torch.zeros(2)}}, tmp_path / "b.pt")
    report = ckpt_tools.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert report.a.passed_over == report.b.passed_over == ("decoder",)
    assert report.to_json()["a"]["passed_over"] == ["decoder"]
    said = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt").stdout
    assert "state dict 'encoder', 3 tensors, also 'decoder', not compared)" in said
    assert "identical: same keys, every tensor bit-equal (not compared: 'decoder')" in said
    assert not ckpt_tools.diff(tmp_path / "a.pt", tmp_path / "b.pt", select="decoder").identical


def test_a_root_whose_tensors_all_lie_deeper_is_refused_with_where(tmp_path: Path) -> None:
    # An optimizer's state dict: compared as the root, no tensor would be, and two different
    # files would be called identical.
    import torch

    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "opt1.pt")
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "opt2.pt")
    with pytest.raises(UsageError, match=r"tensor\(s\) lie deeper \(state\.0\.step") as info:
        ckpt_tools.diff(tmp_path / "opt1.pt", tmp_path / "opt2.pt")
    assert "pass select='state.0'" in str(info.value)
    pair = (tmp_path / "opt1.pt", tmp_path / "opt2.pt")
    report = ckpt_tools.diff(*pair, select="state.0", select_b="state.0")
    assert not report.identical  # the fix it names compares them
