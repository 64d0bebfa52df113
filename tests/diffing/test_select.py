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
