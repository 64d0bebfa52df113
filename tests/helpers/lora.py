"""A tiny PEFT LoRA adapter folder for TinyNet (``layers.0`` and ``head``), written without PEFT.

The examples (doctests, ``--help`` examples, the docs' workspace) name ``lora/`` beside
``model.pt``; its keys and config are PEFT's, its values fixed by a seed. The merge itself is
checked against PEFT in ``tests/ops/merge``, which imports PEFT with :class:`ImportedWhenUsed`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

#: For the test modules that check against PEFT: skipped without PEFT and transformers, and
#: run on one pytest-xdist worker (``--dist loadgroup``), the one process that imports them.
NEEDS_PEFT = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(name) is None for name in ("peft", "transformers")),
        reason="needs peft and transformers (pip install 'ckpt_tools[dev]')",
    ),
    pytest.mark.xdist_group("peft"),
]


class ImportedWhenUsed:
    """A module imported on its first attribute access (``peft.LoraConfig``), not before.

    PEFT and the transformers it imports take seconds to import: named this way, a test
    module costs nothing to collect, and only a process that runs its tests imports them.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # not set yet (a copy), or private: not the module's
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def save_peft_adapter(
    folder: Path, config: Any, layers: int = 2, base_name: str | None = None
) -> Path:
    """A tiny Llama's adapter of ``config``'s type (a PEFT config), saved by PEFT.

    Args:
        folder: where PEFT saves it.
        config: e.g. ``peft.LoraConfig(...)``.
        layers: the Llama's hidden layers.
        base_name: the model's ``name_or_path``, which PEFT saves as
            ``base_model_name_or_path`` (default: none set).

    Returns:
        ``folder``.
    """
    peft = importlib.import_module("peft")
    model = tiny_llama(layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if base_name is not None:
            model.name_or_path = base_name
        peft.get_peft_model(model, config).save_pretrained(folder)
    return folder


#: module -> (in, out) of TinyNet's adapted linears.
_TARGETS = {"layers.0": (8, 8), "head": (8, 3)}
_RANK, _ALPHA = 2, 4


def write_tiny_adapter(folder: Path) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for module, (fan_in, fan_out) in _TARGETS.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((_RANK, fan_in), np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, _RANK), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": "TinyNet",
        "r": _RANK,
        "lora_alpha": _ALPHA,
        "target_modules": sorted(_TARGETS),
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder


def tiny_llama(layers: int = 2, **options: Any) -> Any:
    """A small ``LlamaForCausalLM`` made here (no download); ``options`` go to its config."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        **options,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2(layers: int = 2) -> Any:
    """A small ``GPT2LMHeadModel`` (Conv1D projections, biases everywhere), made here."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)
