"""What merge-lora and ``inspect`` say about what they did: tied names stored once, float64
DoRA as PEFT computes it, and other adapter types described in words that fit them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError
from ckpt_tools.ops.merge.arithmetic import row_norm
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, save_peft_adapter, tiny_llama
from tests.ops.merge.test_merge_lora import EXACT, compare, make_case

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")

#: torch's CPU norm kernel sums in 256-bit registers on these (the order row_norm follows).
_AVX = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _tied_pt(model: Any, folder: Path) -> Path:
    torch.save(model.state_dict(), folder / "base.pt")  # lm_head and embed_tokens: one storage
    return folder / "base.pt"


def test_tied_names_stored_once_are_reported_as_convert_reports_them(tmp_path: Path) -> None:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    case = make_case(
        tmp_path / "case", lambda: tiny_llama(1, tie_word_embeddings=True), config, save=_tied_pt
    )
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    converted = ct.convert(case.base, tmp_path / "c.safetensors")
    assert result.dropped == converted.dropped == ("lm_head.weight",)
    out = load_file(tmp_path / "m.safetensors")
    assert "lm_head.weight" not in out
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # the alias the metadata records
    compare(out, case)
    _, text, _ = run_ckpt(
        "merge-lora", case.base, case.adapter, tmp_path / "j.safetensors", "--json"
    )
    assert json.loads(text)["dropped"] == ["lm_head.weight"]


@pytest.mark.skipif(not _AVX, reason="the order followed is that of torch's 256-bit kernels")
def test_float64_row_norm_sums_as_torch_does() -> None:
    rng = np.random.default_rng(0)
    for width in (8, 16, 64, 100, 256, 1024):  # whole registers of 4 float64 lanes
        rows = rng.standard_normal((5, width))
        want = torch.linalg.norm(torch.from_numpy(rows), dim=1).numpy()
        assert np.array_equal(row_norm(rows), want), width


def test_float64_dora_is_peft(tmp_path: Path) -> None:
    # Bitwise where torch's kernels are AVX2 (MKL's dgemm sums in another order on AVX-512).
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], use_dora=True)
    case = make_case(tmp_path / "case", lambda: tiny_llama(1), config, dtype=torch.float64)
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    differing = compare(torch.load(tmp_path / "m.pt"), case)
    assert differing == [] or not EXACT


def test_other_adapter_types_are_described_in_their_own_terms(tmp_path: Path) -> None:
    ia3 = save_peft_adapter(
        tmp_path / "ia3", peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]), 1
    )
    _, out, _ = run_ckpt("inspect", ia3)
    assert "None" not in out and "modules adapted" not in out
    loha = save_peft_adapter(
        tmp_path / "loha", peft.LoHaConfig(r=2, alpha=4, target_modules=["q_proj"]), 1
    )
    _, out, _ = run_ckpt("inspect", loha)
    assert "rank:        r=2, alpha=4" in out
    with pytest.raises(ConversionError, match="is an IA3 adapter"):
        ct.merge_lora(tmp_path / "missing.pt", ia3, tmp_path / "m.pt")
    path = ia3 / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "peft_type": None}))
    with pytest.raises(ConversionError, match="is an untyped adapter"):
        ct.merge_lora(tmp_path / "missing.pt", ia3, tmp_path / "m.pt")
