"""``structure.wrappers.detect_wrappers`` against torch: a whole-dict wrapper is reported
only where the wrapped model's ``load_state_dict`` takes the keys and the bare one's does not.

DataParallel, DDP and ``torch.compile`` prefix every tensor key, a top-level parameter's too
(a ViT's ``cls_token``); a model of ours with an attribute named ``module`` or ``model`` beside
one is no wrapped model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckpt_tools.structure.wrappers import WRAPPER_RULES, detect_wrappers, strip_wrapper_rules


class _Attribute(nn.Module):
    """A submodule named ``name`` and a top-level parameter beside it."""

    def __init__(self, name: str, top: str) -> None:
        super().__init__()
        self.add_module(name, nn.Linear(2, 2))
        self.register_parameter(top, nn.Parameter(torch.zeros(2)))


def _loads(model: nn.Module, sd: dict[str, torch.Tensor]) -> bool:
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(("name", "top"), [("module", "cls_token"), ("model", "temperature")])
def test_an_attribute_beside_a_top_level_parameter_is_no_wrapper(name: str, top: str) -> None:
    sd = _Attribute(name, top).state_dict()
    assert _loads(_Attribute(name, top), sd)
    assert not _loads(nn.DataParallel(_Attribute(name, top)), sd)
    assert detect_wrappers(list(sd)) == ()
    assert detect_wrappers(sd) == ()
    assert strip_wrapper_rules(sd) == ((), ())


def test_dataparallel_around_it_is_peeled_once() -> None:
    sd = nn.DataParallel(_Attribute("module", "cls_token")).state_dict()
    assert list(sd) == ["module.cls_token", "module.module.weight", "module.module.bias"]
    assert [(m.prefix, m.count, m.of) for m in detect_wrappers(sd)] == [("module.", 3, 3)]


def test_non_tensor_entries_of_a_state_dict_do_not_count() -> None:
    sd: dict[str, object] = dict(nn.DataParallel(_Attribute("fc", "cls_token")).state_dict())
    sd["epoch"] = 3
    sd["note"] = "best"
    assert [(m.prefix, m.count, m.of) for m in detect_wrappers(sd)] == [("module.", 3, 3)]


def test_rules_leave_out_a_wrapper() -> None:
    keys = ["model.embed.weight", "model.norm.weight"]
    assert [m.prefix for m in detect_wrappers(keys)] == ["model."]
    without = tuple(r for r in WRAPPER_RULES if r.prefix != "model.")
    assert detect_wrappers(keys, wrappers=without) == ()


class _Holds(nn.Module):
    """A model whose only child is its own attribute ``model`` (a backbone it wraps)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class _Lightning(nn.Module):
    """A LightningModule's layout: the model under ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Holds()


def _wrapped_state_dicts() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "DataParallel": nn.DataParallel(_Holds()).state_dict(),
        "torch.compile": torch.compile(_Holds()).state_dict(),
        "Lightning": _Lightning().state_dict(),
    }


@pytest.mark.parametrize("wrapped", ["DataParallel", "torch.compile", "Lightning"])
def test_a_models_own_model_attribute_under_a_wrapper_is_kept(wrapped: str) -> None:
    # Lightning's `model.` starts a LightningModule's keys; under DataParallel, compile or
    # Lightning itself, `model.` is the wrapped model's own attribute, which it loads with.
    sd = _wrapped_state_dicts()[wrapped]
    rules, matches = strip_wrapper_rules(sd)
    assert len(matches) == 1, matches
    stripped = {rules[0].apply(k): v for k, v in sd.items()}
    assert _loads(_Holds(), stripped)
    # Lined up with another set of keys, both are peeled alike, `model.` wherever it lies.
    assert [m.prefix for m in detect_wrappers(sd, anywhere=True)][-1] == "model."


def test_a_peft_models_own_model_attribute_is_kept() -> None:
    keys = ["base_model.model.model.layers.0.q_proj.weight", "base_model.model.lm_head.weight"]
    assert [m.prefix for m in detect_wrappers(keys)] == ["base_model.model."]
    keys = ["base_model.model.model.layers.0.q_proj.weight"]
    assert [m.prefix for m in detect_wrappers(keys)] == ["base_model.model."]
    # Lightning's own wrapper of its module (DeepSpeed, Fabric) comes before its `model.`.
    keys = ["_forward_module.model.fc.weight", "_forward_module.model.fc.bias"]
    assert [m.prefix for m in detect_wrappers(keys)] == ["_forward_module.", "model."]


_FSDP2_COMPILED = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
# DTensors under _orig_mod., as torch.compile(model).state_dict() names them
torch.save({f"_orig_mod.{k}": v for k, v in model.state_dict().items()}, sys.argv[1])
dist.destroy_process_group()
"""


def test_wrappers_are_found_in_a_state_dict_of_dtensors(tmp_path) -> None:
    # FSDP2 (and tensor parallel) state dicts hold DTensors, saved as tensor subclasses:
    # keys are keys whatever their values' class, as torch's own consume_prefix strips them.
    import ckpt_tools as ct
    from tests.helpers.child_oracle import run_script

    path = tmp_path / "fsdp2_compiled.pt"
    run_script(_FSDP2_COMPILED, path, check=True)
    ckpt = ct.open_checkpoint(path)
    keys = ["_orig_mod.0.weight", "_orig_mod.0.bias", "_orig_mod.1.weight", "_orig_mod.1.bias"]
    assert list(ckpt.root) == keys
    assert [m.prefix for m in detect_wrappers(ckpt.root)] == ["_orig_mod."]
    assert [m.prefix for m in ct.inspect(path).wrappers] == ["_orig_mod."]
