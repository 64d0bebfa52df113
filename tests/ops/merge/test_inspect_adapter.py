"""``ckpt inspect ADAPTER_DIR``: PEFT's config read beside the weight file's tensors."""

from __future__ import annotations

import json
from pathlib import Path

import ckpt_tools as ct
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, save_peft_adapter, write_tiny_adapter

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")


def _saved(folder: Path, config: object) -> Path:
    return save_peft_adapter(folder, config, layers=2, base_name="tiny-llama")


def test_a_dora_rslora_adapter_is_described(tmp_path: Path) -> None:
    config = peft.LoraConfig(
        r=4,
        lora_alpha=16,
        use_rslora=True,
        use_dora=True,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["lm_head"],
    )
    adapter = _saved(tmp_path / "a", config)
    info = ct.inspect(adapter)
    a = info.format_info
    assert (a.peft_type, a.base_model, a.r, a.alpha, a.rslora, a.dora) == (
        "LORA",
        "tiny-llama",
        4,
        16,
        True,
        True,
    )
    assert sorted(a.target_modules) == ["q_proj", "v_proj"] and len(a.modules) == 4
    assert a.modules_to_save == ("lm_head",) and a.parameters == info.total_params > 0
    _, out, _ = run_ckpt("inspect", adapter)
    assert "adapter:     LORA, rsLoRA, DoRA, base tiny-llama" in out
    assert "(4 modules adapted)" in out and "lm_head (modules_to_save)" in out
    _, out, _ = run_ckpt("inspect", adapter, "--json")
    assert json.loads(out)["format_info"]["modules_to_save"] == ["lm_head"]


def test_other_types_are_named_and_the_tiny_adapter_counted(tmp_path: Path) -> None:
    ia3 = _saved(
        tmp_path / "ia3", peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[])
    )
    assert ct.inspect(ia3).format_info.peft_type == "IA3"
    tiny = ct.inspect(write_tiny_adapter(tmp_path / "lora")).format_info
    # layers.0: A (2, 8) and B (8, 2); head: A (2, 8) and B (3, 2)
    assert tiny.modules == ("head", "layers.0") and tiny.parameters == 16 + 16 + 16 + 6


def test_adapters_of_other_types_peft_loads_are_described_not_refused(tmp_path: Path) -> None:
    # OFT's r is 0 by default (oft_block_size sizes it); a trained AdaLoRA saves its
    # rank_pattern as masks: LoRA's meaning of r and the patterns is not theirs.
    oft = _saved(tmp_path / "oft", peft.OFTConfig(target_modules=["q_proj"], oft_block_size=4))
    assert json.loads((oft / "adapter_config.json").read_text())["r"] == 0
    ada = _saved(tmp_path / "ada", peft.AdaLoraConfig(target_modules=["q_proj"], total_step=4))
    config = json.loads((ada / "adapter_config.json").read_text())
    config["rank_pattern"] = {"model.layers.0.self_attn.q_proj.lora_E": [True, False]}
    (ada / "adapter_config.json").write_text(json.dumps(config))
    for folder, kind in ((oft, "OFT"), (ada, "ADALORA")):
        assert ct.inspect(folder).format_info.peft_type == kind
        assert f"adapter:     {kind}" in run_ckpt("inspect", folder).stdout


def test_trained_biases_and_lora_bias_are_named(tmp_path: Path) -> None:
    plain = ct.inspect(_saved(tmp_path / "plain", peft.LoraConfig(target_modules=["q_proj"])))
    assert (plain.format_info.bias, plain.format_info.lora_bias) == ("none", False)
    config = peft.LoraConfig(target_modules=["q_proj"], bias="lora_only", lora_bias=True)
    adapter = _saved(tmp_path / "biased", config)
    a = ct.inspect(adapter).format_info
    assert (a.bias, a.lora_bias) == ("lora_only", True)
    _, out, _ = run_ckpt("inspect", adapter)
    assert "adapter:     LORA, lora_bias, base tiny-llama" in out
    assert "biases:      lora_only (trained biases saved with the adapter)" in out
    _, plain_out, _ = run_ckpt("inspect", tmp_path / "plain")
    assert "biases:" not in plain_out
    _, out, _ = run_ckpt("inspect", adapter, "--json")
    info = json.loads(out)["format_info"]
    assert (info["bias"], info["lora_bias"]) == ("lora_only", True)
