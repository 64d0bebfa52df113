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
from safetensors.torch import save_model
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
