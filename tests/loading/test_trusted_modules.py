"""``trust=True`` on pickled modules and unloadable pickles, against ``torch.load``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tools import CheckpointError, load_into, load_state_dict, load_with_info
from ckpt_tools.errors import UsageError


class AttrStateDict(dict):
    """A dict subclass as EasyDict or an AttrDict saves a state dict: a class outside the
    allowlist, which only torch.load(weights_only=False) builds."""


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


@pytest.mark.parametrize("where", ["root", "entry"])
def test_trusted_load_takes_a_dict_subclass_as_torch_load_builds_it(
    tmp_path: Path, where: str
) -> None:
    path = tmp_path / "sub.pt"
    sd = AttrStateDict(_model().state_dict())
    torch.save(sd if where == "root" else {"model": sd, "epoch": 3}, path)
    loaded = torch.load(path, weights_only=False)
    ref = loaded if where == "root" else loaded["model"]

    _assert_same(load_state_dict(path, map_location="cpu", trust=True), ref)
    if where == "entry":
        _assert_same(load_state_dict(path, select="model", trust=True), ref)
        return
    # Without trust, the one remedy that works is offered; weights_only=True refuses the file.
    with pytest.raises(Exception, match="AttrStateDict"):
        torch.load(path, weights_only=True)
    with pytest.raises(UsageError, match="AttrStateDict") as refused:
        load_state_dict(path)
    assert "trust=True" in str(refused.value) and "weights_only=True" not in str(refused.value)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing torch._dynamo
@pytest.mark.parametrize("trust", [False, True], ids=["own-reader", "trusted"])
def test_a_pickled_compiled_module_gives_its_state_dict(tmp_path: Path, trust: bool) -> None:
    # torch.save(torch.compile(model)): OptimizedModule pickles as a call on the module it
    # wraps, whose parameters are its state dict under _orig_mod.
    path = tmp_path / "compiled.pt"
    torch.save(torch.compile(_model()), path)
    ref = torch.load(path, weights_only=False).state_dict()
    assert next(iter(ref)).startswith("_orig_mod.")

    _assert_same(load_state_dict(path, map_location="cpu", trust=trust), ref)
    target = _model()
    report = load_into(target, path, map_location="cpu", trust=trust, strict=True)
    assert report.loaded == len(ref) and not report.missing and not report.unexpected


def test_trusted_choice_is_made_in_the_tree_torch_load_builds(tmp_path: Path) -> None:
    # A dict subclass under "model" beside a plain "ema": torch.load's tree holds both, and
    # the choice is the one it gives (model before ema), not the one plain dict left visible.
    model, ema = _model().state_dict(), {k: v + 1 for k, v in _model().state_dict().items()}
    torch.save({"model": AttrStateDict(model), "ema": dict(ema)}, tmp_path / "two.pt")
    _assert_same(load_state_dict(tmp_path / "two.pt", trust=True), model)
    # select goes through dict subclasses as through dicts.
    torch.save({"model": AttrStateDict({"inner": AttrStateDict(model)})}, tmp_path / "deep.pt")
    _assert_same(load_state_dict(tmp_path / "deep.pt", trust=True, select="model.inner"), model)


def test_a_dict_subclass_one_level_down_names_trust_as_at_the_root(tmp_path: Path) -> None:
    # torch.load(weights_only=True) refuses a defaultdict; trusted, it loads the weights.
    import collections

    net = nn.Linear(2, 2)
    held = collections.defaultdict(int, net.state_dict())
    torch.save({"state_dict": held, "epoch": 1}, tmp_path / "dd.pt")
    with pytest.raises(UsageError, match=r"\(state_dict: objects of their own class\)") as info:
        load_state_dict(tmp_path / "dd.pt")
    assert "pass trust=True" in str(info.value)
    with pytest.raises(UsageError, match=r"a defaultdict, a class torch\.load builds only") as info:
        load_state_dict(tmp_path / "dd.pt", select="state_dict")
    assert "pass trust=True" in str(info.value) and "pick a dict entry" not in str(info.value)
    loaded = load_state_dict(tmp_path / "dd.pt", trust=True)
    assert all(torch.equal(loaded[k], v) for k, v in net.state_dict().items())
