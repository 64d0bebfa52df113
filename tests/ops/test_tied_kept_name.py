"""Tied tensors written to safetensors keep the name safetensors' ``save_model`` keeps, in a
single file (a rewrite's or a transform's) and in a folder alike, whatever order the keys
come in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

import ckpt_tools as ct


class _Tied(nn.Module):
    """Two linear layers over one weight, registered in the order given."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        self.add_module(first, nn.Linear(3, 4, bias=False))
        self.add_module(second, nn.Linear(3, 4, bias=False))
        getattr(self, second).weight = getattr(self, first).weight


def _stored(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("order", [("encoder", "decoder"), ("decoder", "encoder")])
def test_the_kept_name_is_the_one_save_model_and_huggingface_hub_keep(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    model = _Tied(*order)
    save_model(model, str(tmp_path / "oracle.safetensors"))
    (tmp_path / "hub").mkdir()
    save_torch_state_dict(model.state_dict(), tmp_path / "hub")
    want = _stored(tmp_path / "oracle.safetensors")
    assert want == _stored(tmp_path / "hub" / "model.safetensors") == ["decoder.weight"]

    src = tmp_path / "tied.pt"
    torch.save(model.state_dict(), src)
    single = ct.convert(src, tmp_path / "out.safetensors")
    folder = ct.convert(src, f"{tmp_path}/out-hf/")
    ct.slim(src, tmp_path / "slim.safetensors", dtype="bfloat16")  # a transform's plan
    assert _stored(tmp_path / "out.safetensors") == want
    assert _stored(tmp_path / "out-hf" / "model.safetensors") == want
    assert _stored(tmp_path / "slim.safetensors") == want
    assert single.dropped == folder.dropped == ("encoder.weight",)
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        tied = json.loads(f.metadata()["ckpt_tools.tied"])
    assert tied == {"encoder.weight": "decoder.weight"}
    # and it reads back whole, both names over one storage
    back = ct.load_state_dict(tmp_path / "out.safetensors")
    assert torch.equal(back["encoder.weight"], model.state_dict()[f"{order[0]}.weight"])
    assert back["encoder.weight"].data_ptr() == back["decoder.weight"].data_ptr()


@pytest.mark.parametrize("rule", [("wte.", "emb."), ("lm_head.", "zz_head.")])
def test_a_rename_that_changes_the_kept_name_writes_it(
    tmp_path: Path, rule: tuple[str, str]
) -> None:
    # The stored name is the first in order; renamed, the other one may come first. The
    # written file is read as safetensors' readers list it, sorted, not in the plan's order.
    emb = torch.randn(10, 8)
    torch.save({"wte.weight": emb, "lm_head.weight": emb, "b": torch.randn(3)}, tmp_path / "t.pt")
    ct.convert(tmp_path / "t.pt", tmp_path / "tied.safetensors")
    assert _stored(tmp_path / "tied.safetensors") == ["b", "lm_head.weight"]
    out = tmp_path / "out.safetensors"
    ct.rename(tmp_path / "tied.safetensors", out, rules=[ct.sub_rule(*rule)])
    renamed = {k.replace(*rule): v for k, v in torch.load(tmp_path / "t.pt").items()}
    save_model(_Holding(renamed), str(tmp_path / "oracle.safetensors"))
    assert _stored(out) == _stored(tmp_path / "oracle.safetensors")
    back = ct.load_state_dict(out)
    assert sorted(back) == sorted(renamed)
    assert all(torch.equal(back[k], v) for k, v in renamed.items())


class _Holding(nn.Module):
    """A module whose state dict is ``tensors``, shared ones shared (what save_model takes)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        made: dict[int, nn.Parameter] = {}
        for name, t in tensors.items():
            module, _, leaf = name.rpartition(".")
            owner = self
            for part in filter(None, module.split(".")):
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            param = made.setdefault(id(t), nn.Parameter(t.clone(), requires_grad=False))
            owner.register_parameter(leaf, param)


def test_tied_tensors_without_elements_keep_every_name(tmp_path: Path) -> None:
    # They share no bytes: safetensors and huggingface_hub store each name, so a strict
    # load_model of our output needs each one too.
    empty = torch.zeros(0)
    model = _Holding({"w": torch.randn(2), "a": empty, "b": empty})
    save_model(model, str(tmp_path / "oracle.safetensors"))
    src = tmp_path / "tied.pt"
    torch.save(model.state_dict(), src)
    ct.convert(src, tmp_path / "out.safetensors")
    ct.convert(src, f"{tmp_path}/out-hf/")
    ct.slim(src, tmp_path / "slim.safetensors", dtype="bfloat16")
    want = _stored(tmp_path / "oracle.safetensors")
    assert want == ["a", "b", "w"]
    for out in ("out.safetensors", "out-hf/model.safetensors", "slim.safetensors"):
        assert _stored(tmp_path / out) == want, out
        assert load_model(_Holding(model.state_dict()), str(tmp_path / out)) == (set(), [])
