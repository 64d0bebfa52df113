"""``trust=True`` on pickled modules and unloadable pickles, against ``torch.load``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tools import CheckpointError, load_into, load_state_dict, load_with_info


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def _assert_same(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert list(ours) == list(ref)
    for key, tensor in ref.items():
        assert torch.equal(ours[key], tensor), key


@pytest.mark.parametrize("wrap", [True, False], ids=["entry", "root"])
def test_trusted_pickled_module_gives_its_state_dict(tmp_path: Path, wrap: bool) -> None:
    path = tmp_path / "whole.pt"
    torch.save({"model": _model(), "epoch": 3} if wrap else _model(), path)
    loaded = torch.load(path, weights_only=False)
    ref = (loaded["model"] if wrap else loaded).state_dict()

    sd, info = load_with_info(path, map_location="cpu", trust=True)

    _assert_same(sd, ref)
    assert info.tensors == len(ref)


def test_trusted_load_into_loads_a_pickled_module(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"
    torch.save({"model": _model(), "epoch": 3}, path)
    ref = torch.load(path, weights_only=False)["model"].state_dict()
    target = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))

    report = load_into(target, path, map_location="cpu", trust=True, strict=True)

    assert report.loaded == len(ref)
    assert not report.unexpected and not report.missing
    _assert_same(target.state_dict(), ref)


def test_trusted_load_of_a_vanished_class_is_typed(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "gone_cfg_module.py").write_text("class Cfg:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_cfg_module  # type: ignore[import-not-found]

    path = tmp_path / "extra.pt"
    torch.save({"w": torch.ones(2), "extra": gone_cfg_module.Cfg()}, path)
    monkeypatch.delitem(sys.modules, "gone_cfg_module")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    (tmp_path / "gone_cfg_module.py").unlink()
    with pytest.raises(ModuleNotFoundError) as torch_error:
        torch.load(path, weights_only=False)

    with pytest.raises(CheckpointError) as ours:
        load_state_dict(path, map_location="cpu", trust=True)

    assert type(ours.value.__cause__) is type(torch_error.value)
    assert "gone_cfg_module" in str(ours.value)
