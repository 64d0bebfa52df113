"""A tiny PEFT LoRA adapter folder for TinyNet (``layers.0`` and ``head``), written without PEFT.

The examples (doctests, ``--help`` examples, the docs' workspace) name ``lora/`` beside
``model.pt``; its keys and config are PEFT's, its values fixed by a seed. The merge itself is
checked against PEFT in ``tests/ops/merge``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

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
