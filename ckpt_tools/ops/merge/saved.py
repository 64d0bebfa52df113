"""An adapter's tensors that are no LoRA part, placed as PEFT's loader places them: trained
biases (``bias="lora_only"`` or ``"all"``) and full ``modules_to_save`` copies, and which
modules ``modules_to_save`` names."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import ConversionError
from ckpt_tools.ops.merge.config_checks import adapted_by_config

__all__ = ["is_saved", "modules_to_save", "saved_module_names", "trained_biases"]

# The heads PEFT's model for a task adds to modules_to_save when it loads the adapter
# (PeftModelForSequenceClassification and the others), whatever the config lists.
_TASK_HEADS = {
    "SEQ_CLS": ("classifier", "score"),
    "TOKEN_CLS": ("classifier", "score"),
    "QUESTION_ANS": ("qa_outputs",),
}


def saved_module_names(config: Mapping[str, Any]) -> list[str]:
    """The names ``modules_to_save`` holds as PEFT loads the adapter: the config's list, and
    the head of its ``task_type`` (``score`` for ``SEQ_CLS``), which older PEFT saved as
    ``modules_to_save: null``.

    Example:
        >>> saved_module_names({"task_type": "SEQ_CLS", "modules_to_save": None})
        ['classifier', 'score']
    """
    names = list(config.get("modules_to_save") or [])
    return names + list(_TASK_HEADS.get(str(config.get("task_type")), ()))


def trained_biases(
    rest: dict[str, TensorRef], targets: set[str], config: Mapping[str, Any], weights: str
) -> dict[str, TensorRef]:
    """The trained biases taken out of ``rest``, by base key, as PEFT's loader places them.

    PEFT loads the adapter's other tensors into the model by name, ignoring names the model
    lacks: ``<target>.base_layer.bias`` is the target's bias, ``<module>.bias`` any other
    module's. A ``modules_to_save`` module's ``bias`` is its trained copy (left in ``rest``);
    the ``original_module`` and ``modules_to_save`` biases ``bias="all"`` saves beside it
    (or beside another adapter's saved module) load into the original module (dropped by the
    merge) or nowhere, so they are dropped.

    Raises:
        ConversionError: a target's bias saved as ``<target>.bias`` (an older PEFT), which
            PEFT now loads nowhere: merging it would not match PEFT, nor would dropping it
            match what was trained.
    """
    names = saved_module_names(config)
    biases: dict[str, TensorRef] = {}
    # A copy under the wrapper's full name is a modules_to_save copy, read as one.
    for key in [k for k in rest if k.endswith(".bias") and ".modules_to_save.default." not in k]:
        module = key[: -len(".bias")]
        owner, _, wrapper = module.rpartition(".")
        parts = module.split(".")
        inside = [i for i, p in enumerate(parts) if p in ("original_module", "modules_to_save")]
        if inside:
            # A wrapper's (or a wrapped parent's submodule's) own bias: this adapter's
            # (dropped by the merge), or another adapter's, loaded nowhere without it.
            del rest[key]
        elif wrapper == "base_layer" and owner in targets:
            biases[f"{owner}.bias"] = rest.pop(key)
        elif wrapper == "base_layer" and adapted_by_config(config, owner) is False:
            del rest[key]  # another adapter's target (a multi-adapter save): loaded nowhere
        elif module in targets:
            raise ConversionError(
                f"{weights!r} holds {key}, a LoRA target's trained bias saved under the "
                "module's own name, as older PEFT saved it; PEFT now loads it nowhere, "
                f"and trained biases saved so are not merged: rename it to {module}."
                "base_layer.bias in the adapter to merge it, or delete it to merge without it"
            )
        elif not is_saved(module, names) and wrapper != "base_layer":
            biases[key] = rest.pop(key)
    return biases


def is_saved(module: str, names: Sequence[str]) -> bool:
    """Whether ``module`` is in one of ``modules_to_save``, matched as PEFT matches them:
    any module whose path ends with a name (plain text: ``head`` wraps ``lm_head``) is
    wrapped whole, its submodules included (RoBERTa's ``classifier.dense``)."""
    parts = module.split(".")
    paths = (".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return any(p.endswith(n) for p in paths for n in names)


def modules_to_save(
    rest: Mapping[str, TensorRef], config: Mapping[str, Any], weights: str
) -> dict[str, TensorRef]:
    """The full copies of ``modules_to_save``, by base key; any other key is refused."""
    names = saved_module_names(config)
    saved: dict[str, TensorRef] = {}
    unknown = []
    for key, t in rest.items():
        key = key.replace(".modules_to_save.default.", ".")  # the wrapper's own name, if saved
        module = key.rsplit(".", 1)[0]
        # ensure_weight_tying saves the modules tied to a saved one too (PEFT ties them)
        if is_saved(module, names) or config.get("ensure_weight_tying"):
            saved[key] = t
        else:
            unknown.append(key)
    if unknown:
        raise ConversionError(
            f"{weights!r} holds tensors that are no LoRA part nor in modules_to_save: "
            + ", ".join(unknown[:8])
        )
    return saved
