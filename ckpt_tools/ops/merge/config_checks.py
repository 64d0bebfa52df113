"""``adapter_config.json`` checked as PEFT reads it: its values' types, and the modules it
makes PEFT adapt, set beside the tensors the weight file holds.

PEFT follows the config where it and the tensors disagree (it injects the modules the config
names, and builds DoRA layers only when ``use_dora`` is set), so a merge that followed the
tensors instead would write other weights than PEFT's: such adapters are refused.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ckpt_tools.errors import ConversionError, CorruptCheckpointError

__all__ = [
    "adapted_by_config",
    "check_config_targets",
    "check_config_values",
    "rank_alpha",
]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# The fields naming modules and layers, as PEFT's LoraConfig types them (JSON null for None):
# a value alone, or a list of such values.
_NAMES = "a module name (or a regular expression) or a list of module names"
_SHAPES = (
    ("target_modules", (str,), _NAMES),
    ("exclude_modules", (str,), _NAMES),
    ("layers_pattern", (str,), _NAMES),
    ("modules_to_save", (), "a list of module names"),
    ("layers_to_transform", (int,), "a layer index or a list of them"),
)


def _of_kind(value: Any, alone: tuple[type, ...]) -> bool:
    """``value`` is one of ``alone`` or a list of them (a list of strings where ``alone`` is
    empty); never a bool."""
    kinds = alone or (str,)
    if isinstance(value, list):
        return all(isinstance(v, kinds) and not isinstance(v, bool) for v in value)
    return isinstance(value, alone) and not isinstance(value, bool)


def check_config_values(path: str, config: Mapping[str, Any]) -> None:
    """Refuse a LoRA config whose rank, alpha or patterns PEFT could not use.

    Args:
        path: the adapter folder (named in the error).
        config: ``adapter_config.json`` as parsed.

    Raises:
        CorruptCheckpointError: ``r`` not a positive integer, ``lora_alpha`` not a number,
            ``rank_pattern`` / ``alpha_pattern`` not an object of such values keyed by
            regular expressions, module names or layer indexes of another type, each naming
            the field.

    Example:
        >>> check_config_values("lora", {"r": 4, "lora_alpha": 8, "rank_pattern": {"fc1": 2}})
    """
    where = f"{path!r}: adapter_config.json"
    if "r" in config and not _rank(config["r"]):
        raise CorruptCheckpointError(f"{where}'s r is {config['r']!r}, not a positive integer")
    if "lora_alpha" in config and not _number(config["lora_alpha"]):
        raise CorruptCheckpointError(
            f"{where}'s lora_alpha is {config['lora_alpha']!r}, not a number"
        )
    for field, kinds, what in _SHAPES:
        value = config.get(field)
        if value is not None and not _of_kind(value, kinds):
            raise CorruptCheckpointError(f"{where}'s {field} is {value!r}, not {what}")
    for field, valid, what in (
        ("rank_pattern", _rank, "a positive integer"),
        ("alpha_pattern", _number, "a number"),
    ):
        patterns = config.get(field) or {}
        if not isinstance(patterns, Mapping):
            raise CorruptCheckpointError(
                f"{where}'s {field} is {patterns!r}, not an object of module patterns"
            )
        for key, value in patterns.items():
            if not valid(value):
                raise CorruptCheckpointError(f"{where}'s {field}[{key!r}] is {value!r}, not {what}")
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as e:
                raise CorruptCheckpointError(
                    f"{where}'s {field} key {key!r} is not a regular expression: {e}"
                ) from e


def adapted_by_config(config: Mapping[str, Any], module: str) -> bool | None:
    """Whether PEFT's ``check_target_module_exists`` adapts ``module`` under this config.

    Returns:
        True or False; None where the config cannot tell (no ``target_modules``, or
        ``all-linear``, which PEFT resolves from the model's module classes).

    Example:
        >>> adapted_by_config({"target_modules": ["q_proj"]}, "layers.0.q_proj")
        True
    """
    excluded = config.get("exclude_modules")
    if isinstance(excluded, str) and excluded:
        if re.fullmatch(excluded, module):
            return False
    elif excluded and (module in excluded or any(module.endswith(f".{e}") for e in excluded)):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return None
        return re.fullmatch(targets, module) is not None
    if not targets:
        return None
    if module in targets:
        return True
    if not any(module.endswith(f".{t}") for t in targets):
        return False
    return _in_layers(config, module)


def _in_layers(config: Mapping[str, Any], module: str) -> bool:
    """``layers_to_transform`` / ``layers_pattern`` as PEFT applies them to list targets."""
    layers = config.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    patterns = config.get("layers_pattern")
    match = None
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


def check_config_targets(
    weights: str, config: Mapping[str, Any], adapted: Mapping[str, bool]
) -> None:
    """Refuse an adapter whose config and weight file disagree on what PEFT merges.

    Args:
        weights: the weight file (named in the error).
        config: ``adapter_config.json`` as parsed.
        adapted: each module with LoRA parts in the weight file -> whether it holds a DoRA
            magnitude vector.

    Raises:
        ConversionError: a module the config's ``target_modules`` / ``exclude_modules`` /
            ``layers_to_transform`` leave out (PEFT does not adapt it, so would not merge it),
            or ``use_dora`` set where the tensors hold no magnitude, or unset where they do.

    Example:
        >>> check_config_targets("lora/adapter_model.safetensors", {"target_modules": ["fc"]},
        ...                      {"fc": False})
    """
    left_out = [m for m in adapted if adapted_by_config(config, m) is False]
    _refuse_layers_not_merged(weights, config, left_out)
    if left_out:
        raise ConversionError(
            f"{weights!r} holds LoRA tensors for {', '.join(left_out[:8])}, which "
            "adapter_config.json's target_modules / exclude_modules / layers_to_transform "
            "leave out: PEFT does not adapt (nor merge) them. Correct the config, or delete "
            "those tensors to merge without them"
        )
    dora = bool(config.get("use_dora"))
    wrong = [m for m, magnitude in adapted.items() if magnitude != dora]
    if wrong:
        held = "holds no" if dora else "holds a"
        raise ConversionError(
            f"adapter_config.json sets use_dora={dora}, but {weights!r} {held} "
            f"lora_magnitude_vector for {', '.join(wrong[:8])}: PEFT follows the config and "
            f"would merge them as {'DoRA' if dora else 'plain LoRA'}. Correct use_dora in "
            "the config to match the weights"
        )


def _refuse_layers_not_merged(weights: str, config: Mapping[str, Any], left_out: list[str]) -> None:
    """Refuse, naming why, the LoRA tensors the config leaves out that PEFT does merge: a
    layer's own inner module (``attn.base_layer.out_proj``: PEFT's MultiheadAttention wraps
    it), or a head ``ensure_weight_tying`` adapts with the embedding it is tied to."""
    inner = [m for m in left_out if ".base_layer." in m]
    if inner:
        raise ConversionError(
            f"{weights!r} holds LoRA tensors inside a layer PEFT adapts whole "
            f"({', '.join(inner[:4])}: an nn.MultiheadAttention's, for one), which merge-lora "
            "does not merge: only Linear, Conv1D, convolution and Embedding layers"
        )
    if left_out and config.get("ensure_weight_tying"):
        raise ConversionError(
            f"{weights!r} holds LoRA tensors for {', '.join(left_out[:4])}, which PEFT "
            "adapts with the embedding it is tied to (ensure_weight_tying), a delta each into "
            "the one tied weight; merge-lora does not merge that: train the adapter without "
            "ensure_weight_tying"
        )


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The first pattern that names ``module``, as PEFT's ``get_pattern_key`` finds it."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def rank_alpha(config: Mapping[str, Any], module: str) -> tuple[int, float, float]:
    """The module's rank, alpha and scaling, as PEFT's ``LoraModel`` sets them (the config's
    values checked by :func:`check_config_values` first).

    Example:
        >>> rank_alpha({"r": 4, "lora_alpha": 8, "rank_pattern": {"fc2": 2}}, "fc2")
        (2, 8, 4.0)
    """
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    r_key, a_key = _pattern_key(ranks, module), _pattern_key(alphas, module)
    r = int(ranks[r_key] if r_key is not None else config.get("r", 8))
    alpha = alphas[a_key] if a_key is not None else config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, alpha, scaling
