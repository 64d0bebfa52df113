"""Tied tensors written to safetensors keep the first of their names in key order, as
transformers' ``save_pretrained`` keeps the embedding rather than the head tied to it, in a
single file (a rewrite's or a transform's) and in a folder alike; safetensors' ``load_model``
and transformers' base model classes load the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
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
def test_the_kept_name_is_the_first_in_key_order_and_load_model_takes_it(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    model = _Tied(*order)
    src = tmp_path / "tied.pt"
    torch.save(model.state_dict(), src)
    single = ct.convert(src, tmp_path / "out.safetensors")
    folder = ct.convert(src, f"{tmp_path}/out-hf/")
    ct.slim(src, tmp_path / "slim.safetensors", dtype="bfloat16")  # a transform's plan
    first, second = (f"{name}.weight" for name in order)
    for out in ("out.safetensors", "out-hf/model.safetensors", "slim.safetensors"):
        assert _stored(tmp_path / out) == [first], out
    assert single.dropped == folder.dropped == (second,)
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        tied = json.loads(f.metadata()["ckpt_tools.tied"])
    assert tied == {second: first}
    # safetensors' own loader ties the other name back (strict: nothing missing)
    assert load_model(_Tied(*order), str(tmp_path / "out.safetensors")) == (set(), [])
    back = ct.load_state_dict(tmp_path / "out.safetensors")
    assert torch.equal(back[second], model.state_dict()[first])
    assert back[first].data_ptr() == back[second].data_ptr()


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_a_tied_model_keeps_the_names_save_pretrained_keeps_and_loads_as_its_base_model(
    tmp_path: Path, name: str
) -> None:
    # The embedding, not the head tied to it: a base model class (AutoModel, a T5 encoder)
    # loads no head, and a folder holding only the head would leave its embedding random.
    transformers = pytest.importorskip("transformers")
    from tests.helpers.lora import tiny_gpt2, tiny_llama

    torch.manual_seed(0)
    if name == "t5":
        config = transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4
        )
        model = transformers.T5ForConditionalGeneration(config)
        base_class = transformers.T5EncoderModel
    else:
        model = tiny_gpt2(1) if name == "gpt2" else tiny_llama(1, tie_word_embeddings=True)
        base_class = transformers.AutoModel
    model.save_pretrained(tmp_path / "oracle")
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    ct.convert(tmp_path / "sd.pt", f"{tmp_path}/ours/")
    (tmp_path / "ours" / "config.json").write_bytes(
        (tmp_path / "oracle" / "config.json").read_bytes()
    )
    assert _stored(tmp_path / "ours" / "model.safetensors") == _stored(
        tmp_path / "oracle" / "model.safetensors"
    )
    loaded, info = base_class.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    want = base_class.from_pretrained(tmp_path / "oracle").state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


@pytest.mark.parametrize("rule", [("wte.", "emb."), ("lm_head.", "zz_head.")])
def test_a_rename_that_changes_the_kept_name_writes_it(
    tmp_path: Path, rule: tuple[str, str]
) -> None:
    # The stored name is the first in key order, renamed as any other key. The written file
    # is read as safetensors' readers list it, sorted, not in the plan's order.
    emb = torch.randn(10, 8)
    torch.save({"wte.weight": emb, "lm_head.weight": emb, "b": torch.randn(3)}, tmp_path / "t.pt")
    ct.convert(tmp_path / "t.pt", tmp_path / "tied.safetensors")
    assert _stored(tmp_path / "tied.safetensors") == ["b", "wte.weight"]
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
