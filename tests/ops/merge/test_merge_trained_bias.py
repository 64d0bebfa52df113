"""Trained biases (``LoraConfig(bias="lora_only")`` or ``bias="all"``) merged as PEFT merges
them: ``PeftModel.from_pretrained`` loads the adapter's biases in place of the base's (copied
in the base's dtype), and ``merge_and_unload()`` keeps them; ``lora_bias`` merges on top."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpt_tools as ct
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, tiny_gpt2, tiny_llama
from tests.ops.merge.test_merge_lora import Case, compare, make_case

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")
transformers = ImportedWhenUsed("transformers")

_PREFIX = "base_model.model."


def _llama_biased() -> Any:
    """A one-layer Llama whose attention and MLP projections are Linear layers with biases."""
    return tiny_llama(layers=1, attention_bias=True, mlp_bias=True)


def _gpt2() -> Any:
    """A one-layer GPT-2: Conv1D projections and LayerNorms, all with biases."""
    return tiny_gpt2(layers=1)


class _TiedBias(torch.nn.Module):
    """Two Linear layers sharing one bias parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)
        self.head.bias = self.fc.bias


def _tied_pt(model: Any, folder: Path) -> Path:
    torch.save(model.state_dict(), folder / "base.pt")  # fc.bias and head.bias: one storage
    return folder / "base.pt"


def _lora(*names: str, **kwargs: Any) -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(names), **kwargs)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Case]:
    """Each case built once for the module, on first use."""
    root = tmp_path_factory.mktemp("trained-bias")
    made: dict[str, Case] = {}
    conv1d = {"fan_in_fan_out": True}
    recipes: dict[str, Callable[[Path], Case]] = {
        "lora-only": lambda f: make_case(f, _llama_biased, _lora("q_proj", bias="lora_only")),
        "all": lambda f: make_case(f, _gpt2, _lora("c_attn", bias="all", **conv1d)),
        "all-saved": lambda f: make_case(
            f, _gpt2, _lora("c_attn", bias="all", modules_to_save=["c_fc"], **conv1d)
        ),
        "all-lora-bias": lambda f: make_case(
            f, _gpt2, _lora("c_attn", bias="all", lora_bias=True, **conv1d)
        ),
        "lora-only-lora-bias": lambda f: make_case(
            f, _llama_biased, _lora("v_proj", "up_proj", bias="lora_only", lora_bias=True)
        ),
        "bf16": lambda f: make_case(
            f, _llama_biased, _lora("q_proj", bias="all"), dtype=torch.bfloat16
        ),
        "bf16-base-fp32-trained": lambda f: make_case(
            f,
            _llama_biased,
            _lora("k_proj", bias="lora_only", lora_bias=True),
            dtype=torch.bfloat16,
            train_dtype=torch.float32,
        ),
        "tied": lambda f: make_case(f, _TiedBias, _lora("fc", bias="lora_only"), save=_tied_pt),
    }

    def get(name: str) -> Case:
        if name not in made:
            made[name] = recipes[name](root / name)
        return made[name]

    return get


def _changed_biases(case: Case) -> set[str]:
    """The bias keys PEFT's merge changed: the oracle must change some for a test to mean it."""
    changed = {
        k
        for k, v in case.merged.items()
        if k.endswith(".bias") and not torch.equal(v, case.base_sd[k])
    }
    assert changed
    return changed


def _load(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    return torch.load(path) if path.suffix == ".pt" else load_file(path)


@pytest.mark.parametrize(
    ("name", "out"),
    [
        ("lora-only", "m.pt"),
        ("lora-only", "m.safetensors"),
        ("lora-only", "m-hf/"),
        ("all", "m.pt"),
        ("all", "m.safetensors"),
        ("all-saved", "m.pt"),
        ("all-lora-bias", "m.safetensors"),
        ("lora-only-lora-bias", "m.pt"),
        ("bf16", "m.safetensors"),
        ("bf16-base-fp32-trained", "m.pt"),
    ],
)
def test_trained_biases_are_bitwise_peft(
    cases: Callable[[str], Case], tmp_path: Path, name: str, out: str
) -> None:
    case = cases(name)
    changed = _changed_biases(case)
    result = ct.merge_lora(case.base, case.adapter, f"{tmp_path}/{out}")
    assert changed <= set(result.biases) | set(result.replaced)
    got = _load(tmp_path / out)
    if out.endswith("/"):  # safetensors shards hold a tied tensor once, as save_pretrained
        case = case._replace(base_sd={k: case.base_sd[k] for k in got})
    compare(got, case)


def test_bias_all_replaces_biases_of_modules_that_are_no_target(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("all")
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert {"transformer.ln_f.bias", "transformer.h.0.mlp.c_fc.bias"} <= set(result.biases)
    actions = {r.key: r.action for r in result.rows}
    assert actions["transformer.h.0.ln_1.bias"] == "replace (trained bias)"
    assert actions["transformer.h.0.attn.c_attn.bias"] == "replace (trained bias)"


def test_a_saved_module_keeps_its_trained_copy_s_bias(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    # bias="all" saves the wrapper's original_module and modules_to_save biases beside the
    # copy: PEFT's merge keeps the copy, whose bias is the trained one.
    case = cases("all-saved")
    saved = load_file(case.adapter / "adapter_model.safetensors")
    assert f"{_PREFIX}transformer.h.0.mlp.c_fc.original_module.bias" in saved
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    key = "transformer.h.0.mlp.c_fc.bias"
    assert key in result.replaced and key not in result.biases
    compare(torch.load(tmp_path / "m.pt"), case)


def test_lora_bias_merges_onto_the_trained_bias(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("all-lora-bias")
    key = "transformer.h.0.attn.c_attn.bias"
    _, out, _ = run_ckpt("merge-lora", case.base, case.adapter, tmp_path / "m.pt", "--dry-run")
    assert "merge lora bias onto the trained bias" in out
    assert f"replace (trained bias)    {key}" in out
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert torch.equal(torch.load(tmp_path / "m.pt")[key], case.merged[key])


def test_dtype_casts_the_trained_biases_after_merging(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("lora-only")
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt", dtype="bf16")
    out = torch.load(tmp_path / "m.pt")
    for key in _changed_biases(case):
        assert torch.equal(out[key], case.merged[key].to(torch.bfloat16)), key


def test_a_target_s_bias_under_the_module_s_own_name_is_refused(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    # Older PEFT saved a target's bias as <module>.bias; PEFT now loads that key nowhere.
    case = cases("lora-only")
    adapter = tmp_path / "old"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_bytes(
        (case.adapter / "adapter_config.json").read_bytes()
    )
    tensors = load_file(case.adapter / "adapter_model.safetensors")
    save_file(
        {k.replace(".base_layer.bias", ".bias"): v for k, v in tensors.items()},
        adapter / "adapter_model.safetensors",
    )
    _, _, err = run_ckpt("merge-lora", case.base, adapter, tmp_path / "m.pt", code=7)
    assert "model.layers.0.self_attn.q_proj.bias" in err
    assert "trained biases saved so are not merged" in err and "base_layer.bias" in err
    assert not (tmp_path / "m.pt").exists()


def test_a_trained_bias_tied_to_another_changes_both(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    # Loading copies the trained bias into the one shared parameter: PEFT's merge changes
    # head.bias too, though only the target's bias is saved.
    case = cases("tied")
    assert _changed_biases(case) == {"fc.bias", "head.bias"}
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert result.biases == ("fc.bias",)
    compare(torch.load(tmp_path / "m.pt"), case)
