"""An adapter folder as ``inspect`` describes it: PEFT's config beside the weight file's tensors."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckpt_tools._types import Select
from ckpt_tools.errors import CheckpointNotFoundError
from ckpt_tools.errors import shown as escaped
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.ops.inspect.info import CheckpointInfo
from ckpt_tools.ops.merge.adapter import WEIGHT_NAMES, read_config, target_modules
from ckpt_tools.ops.merge.config_checks import check_config_values
from ckpt_tools.ops.merge.saved import saved_module_names
from ckpt_tools.structure.json_values import json_ready

__all__ = ["AdapterInfo", "inspect_adapter"]


@dataclass(frozen=True)
class AdapterInfo:
    """What a PEFT adapter folder is, beside its tensors (``ckpt inspect`` reports it).

    Attributes:
        peft_type: ``LORA``, ``IA3``, ``LOHA`` ... as the config says.
        base_model: ``base_model_name_or_path``.
        r, alpha: the config's rank and alpha (None where the type has none).
        rslora, dora: ``use_rslora``, ``use_dora``.
        bias: the config's ``bias``: ``none``, or ``lora_only``/``all`` where trained biases
            are saved with the adapter (they replace the base's when it is loaded or merged).
        lora_bias: ``lora_bias``, a bias on each ``lora_B``.
        target_modules: the config's ``target_modules`` (a list, or a regex string).
        modules: the modules the weight file adapts (LoRA parts found), in file order.
        modules_to_save: the config's ``modules_to_save``.
        patterns: ``rank_pattern`` and ``alpha_pattern`` entries.
        parameters: elements of every tensor in the weight file.
    """

    peft_type: str
    base_model: str | None
    r: int | None
    alpha: float | None
    rslora: bool
    dora: bool
    bias: str
    lora_bias: bool
    target_modules: Any
    modules: tuple[str, ...]
    modules_to_save: tuple[str, ...]
    patterns: Mapping[str, Mapping[str, Any]]
    parameters: int

    def lines(self) -> list[str]:
        """The summary lines ``ckpt inspect`` prints for it."""
        targets = self.target_modules
        shown = ", ".join(targets) if isinstance(targets, list) else repr(targets)
        flags = (("rsLoRA", self.rslora), ("DoRA", self.dora), ("lora_bias", self.lora_bias))
        variant = "".join(f", {name}" for name, on in flags if on)
        lines = [f"adapter:     {self.peft_type}{variant}, base {self.base_model or '?'}"]
        rank = [f"{k}={v}" for k, v in (("r", self.r), ("alpha", self.alpha)) if v is not None]
        rank += [f"{k} {dict(v)}" for k, v in self.patterns.items() if v]
        if rank:  # IA3 has neither rank nor alpha
            lines.append(f"rank:        {', '.join(rank)}")
        # only LoRA's parts are counted in the weight file
        counted = f" ({len(self.modules)} modules adapted)" if self.peft_type == "LORA" else ""
        lines.append(f"targets:     {shown}{counted}")
        if self.bias != "none":
            lines.append(f"biases:      {self.bias} (trained biases saved with the adapter)")
        if self.modules_to_save:
            lines.append(f"saved:       {', '.join(self.modules_to_save)} (modules_to_save)")
        return [escaped(line) for line in lines]  # names from the adapter's config

    def to_json(self) -> dict[str, Any]:
        # A config's alpha may be infinite: strict JSON names it ("inf"), as --json prints.
        return json_ready(
            {
                "peft_type": self.peft_type,
                "base_model": self.base_model,
                "r": self.r,
                "alpha": self.alpha,
                "rslora": self.rslora,
                "dora": self.dora,
                "bias": self.bias,
                "lora_bias": self.lora_bias,
                "target_modules": self.target_modules,
                "modules": list(self.modules),
                "modules_to_save": list(self.modules_to_save),
                "patterns": {k: dict(v) for k, v in self.patterns.items()},
                "parameters": self.parameters,
            }
        )


def inspect_adapter(path: str, select: Select = None) -> CheckpointInfo:
    """Describe an adapter folder: its weight file as ``inspect`` describes any file, and
    the adapter's config (:class:`AdapterInfo`, the result's ``format_info``).

    Raises:
        CheckpointNotFoundError: no weight file beside ``adapter_config.json``.
        CorruptCheckpointError: the config is not a JSON object, or (a LoRA adapter's) its
            rank, alpha or patterns are not values PEFT could use (the field named).

    Example:
        >>> info = inspect_adapter("lora")
        >>> info.format_info.peft_type, info.format_info.modules
        ('LORA', ('head', 'layers.0'))
    """
    from ckpt_tools.ops.inspect.inspection import inspect_checkpoint

    config = read_config(path)
    if config.get("peft_type") == "LORA":  # r, alpha and the patterns mean LoRA's here
        check_config_values(path, config)
    weights = next(
        (os.path.join(path, n) for n in WEIGHT_NAMES if os.path.isfile(os.path.join(path, n))),
        None,
    )
    if weights is None:
        raise CheckpointNotFoundError(f"{path!r} holds no {' or '.join(WEIGHT_NAMES)}")
    info = inspect_checkpoint(open_checkpoint(weights), select)
    lora = config.get("peft_type") == "LORA"
    adapter = AdapterInfo(
        peft_type=str(config.get("peft_type", "?")),
        base_model=config.get("base_model_name_or_path"),
        r=config.get("r"),
        alpha=config.get("lora_alpha", config.get("alpha")),  # LoHa and LoKr name it alpha
        rslora=bool(lora and config.get("use_rslora")),
        dora=bool(lora and config.get("use_dora")),
        bias=str(config.get("bias") or "none"),
        lora_bias=bool(lora and config.get("lora_bias")),
        target_modules=config.get("target_modules"),
        modules=target_modules(t.name for t in info.tensors),
        modules_to_save=tuple(saved_module_names(config)),
        patterns={k: config.get(k) or {} for k in ("rank_pattern", "alpha_pattern")},
        parameters=info.total_params,
    )
    return replace(info, format_info=adapter)
