"""``sanitize`` of dict subclasses (a user's OrderedDict, an EasyDict, an AttrDict): their
items become a plain dict, a state dict held in one is found and verified in the output, and
attributes that are more than a mirror of an item are listed as dropped."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct

CLASSES = """
import collections


class StateDict(collections.OrderedDict):
    pass


class AttrDict(dict):
    pass


class EasyDict(dict):
    def __init__(self, **kw):
        super().__init__(**kw)
        for k, v in kw.items():
            setattr(self, k, v)

    def __setattr__(self, k, v):
        super().__setattr__(k, v)
        self[k] = v


class SelfDict(dict):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.__dict__ = self
"""


def _saved(tmp_path: Path, protocol: int = 2) -> tuple[Path, dict]:
    """A checkpoint of dict subclasses, and torch.load(weights_only=False)'s reading of it."""
    (tmp_path / "dictsubs_mod.py").write_text(CLASSES)
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("dictsubs_mod")
        torch.manual_seed(0)
        easy = mod.EasyDict(a=1, lr=0.25, b=torch.ones(2))
        object.__setattr__(easy, "extra", "only an attribute")
        ckpt = {
            "state_dict": mod.StateDict(torch.nn.Linear(2, 3).state_dict()),
            "cfg": mod.AttrDict(lr=0.1, steps=[1, 2]),
            "easy": easy,
            "self": mod.SelfDict(x=2),
        }
        path = tmp_path / "dictsubs.pt"
        torch.save(ckpt, path, pickle_protocol=protocol)
        oracle = torch.load(path, weights_only=False)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("dictsubs_mod", None)
        (tmp_path / "dictsubs_mod.py").unlink()
    return path, oracle


# Protocol 1 (and 0) pickles a dict subclass as copyreg._reconstructor(cls, dict, items).
@pytest.mark.parametrize("protocol", [1, 2])
def test_dict_subclasses_become_dicts_of_their_items(tmp_path: Path, protocol: int) -> None:
    src, oracle = _saved(tmp_path, protocol)
    result = ct.sanitize(src, tmp_path / "out.pt", verify="full")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == list(oracle)
    for key, value in oracle.items():
        assert type(out[key]) is dict and list(out[key]) == list(value), key
        for k, v in value.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(out[key][k], v) and out[key][k].dtype == v.dtype
            else:
                assert out[key][k] == v
    # The state dict is found once it is a dict, and its tensors are the ones verified.
    assert result.selected == ("state_dict",) and result.tensors == 2
    assert "verified: 2 tensors" in result.verification
    converted = {c.path: c.was for c in result.converted}
    assert converted == {
        "state_dict": "dictsubs_mod.StateDict",
        "cfg": "dictsubs_mod.AttrDict",
        "easy": "dictsubs_mod.EasyDict",
        "self": "dictsubs_mod.SelfDict",
    }
    # EasyDict's attributes mirror its items; the one that does not is lost, and said.
    assert [(c.path, c.was) for c in result.dropped_values] == [
        ("easy.extra", "attribute of a dictsubs_mod.EasyDict")
    ]


def test_an_empty_dict_subclass_is_dropped_as_an_object(tmp_path: Path) -> None:
    (tmp_path / "dictsubs_mod.py").write_text(CLASSES)
    sys.path.insert(0, str(tmp_path))
    try:
        torch.save(
            {"w": torch.ones(1), "cfg": importlib.import_module("dictsubs_mod").AttrDict()},
            tmp_path / "e.pt",
        )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("dictsubs_mod", None)
    # Nothing in the pickle tells an empty dict subclass from any other object.
    result = ct.sanitize(tmp_path / "e.pt", tmp_path / "out.pt")
    assert [(c.path, c.became) for c in result.dropped_values] == [("cfg", "dropped")]
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == ["w"]
