"""The base tensors an adapter replaces rather than merges into: ``modules_to_save`` copies,
and the trained biases of ``bias="lora_only"`` or ``"all"``.

PEFT swaps a saved module for its trained copy, so a tie to that module's weight is broken;
a trained bias is copied into the parameter, so every key viewing it takes the copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.dtypes import FLOATING
from ckpt_tools.errors import ConversionError
from ckpt_tools.io.row_layout import row_layout
from ckpt_tools.io.writers.records import Record
from ckpt_tools.io.writers.safetensors_checks import is_output_head
from ckpt_tools.io.writers.saved_tensors import fresh_tensor, saved_storage, saved_tensor
from ckpt_tools.ops.merge.adapter import LoraAdapter
from ckpt_tools.ops.merge.layout import tied_head
from ckpt_tools.ops.merge.records import replace_record
from ckpt_tools.ops.merge.saved import is_saved, saved_module_names

__all__ = ["check_whole", "plan_replacements"]

# PEFT gives a saved head its own weight apart from the embedding the base ties it to.
_UNTIE = (
    ", left out of the base as tied by config.json's tie_word_embeddings, which PEFT unties: "
    "save the base untied (tie_word_embeddings false, the head's weight written) and merge that"
)

# A saved module the base lacks is added under its name only where the base's keys are the
# adapter's names: elsewhere the model class would not find it.
_ELSEWHERE = (
    ", which is added only to a base whose keys are the adapter's names, and this base's "
    "keys are named otherwise (a prefix apart): save the base under the adapter's names"
)


def check_whole(key: str, t: TensorRef) -> None:
    """A merged tensor is written as its whole storage, row by row: refuse a view of part of
    one, and a layout whose rows do not lie back to back (a ``channels_last`` kernel's do).

    Raises:
        ConversionError: ``t`` is a view of part of its storage, or strided otherwise.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> storage = StorageRef("0", "float32", 4, "cpu")
        >>> check_whole("w", TensorRef(storage, 0, (4,), (1,), "float32"))
    """
    if t.offset != 0 or t.storage.nbytes != t.nbytes:
        problem = "is a view of part of a storage"
    elif row_layout(t) is None:
        problem = f"is laid out with strides {list(t.stride)} (a transposed or strided view)"
    else:
        return
    raise ConversionError(
        f"{key!r} {problem}; merge-lora merges tensors that fill their storage row after row "
        "(convert the base to safetensors first)"
    )


def plan_replacements(
    aligned: Mapping[str, tuple[str, TensorRef]],
    lora: LoraAdapter,
    overrides: dict[int, Record],
    actions: dict[str, str],
    config: Mapping[str, Any] | None = None,
) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, TensorRef]]:
    """The records replacing base tensors by their ``modules_to_save`` copies, and base biases
    by the adapter's trained ones (those ``lora_bias`` merges into are planned already).

    Args:
        config: the base's config.json, whose ``tie_word_embeddings`` explains a saved head
            left out of the base.

    Returns:
        The keys replaced by ``modules_to_save`` copies; the keys given trained biases
        (``lora_bias`` merges included); and the tensors put in place of saved modules' that
        shared their storage with another key (tied embeddings: PEFT swaps the module for its
        trained copy, so the tie is broken and the other keys keep the base's values). A
        trained bias is copied into the parameter, tied or not, so every key viewing its
        storage takes it.

    Raises:
        ConversionError: a copy missing from the base or of another shape; a copy replacing
            the one weight a tied head left out of the base merges into.
    """
    merged_into = set(overrides)
    problems, replaced, biases = [], [], []
    untied: dict[str, TensorRef] = {}
    viewers = Counter(id(t.storage) for _, t in aligned.values())
    merged = {f"{t.module}.bias" for t in lora.targets if t.bias is not None}
    todo = [(name, saved, "modules_to_save") for name, saved in lora.modules_to_save.items()]
    todo += [(name, saved, "trained bias") for name, saved in lora.biases.items()]
    for name, saved, why in todo:
        found = aligned.get(name)
        if found is None and why == "modules_to_save" and _tied_copy(name, lora):
            continue  # the base ties it to the saved module whose copy replaces it
        if found is None and why == "modules_to_save" and _addable(name, aligned):
            # A module the model class builds and PEFT fills with its copy (SEQ_CLS's score
            # on a language model's base): written as the adapter saved it.
            added = fresh_tensor(replace(saved, dtype=_base_dtype(aligned, saved)))
            untied[name] = added
            overrides[id(added.storage)] = replace_record(lora.ckpt, saved, added, why)
            actions[name] = "add (modules_to_save, not in the base)"
            replaced.append(name)
            continue
        if found is None or found[1].shape != saved.shape:
            problems.append(f"{name} ({why}: {'shape differs' if found else 'missing'})")
            if found is None and why == "modules_to_save" and not is_output_head(name):
                problems[-1] += _ELSEWHERE
            if (
                found is None
                and (config or {}).get("tie_word_embeddings") is True
                and why == "modules_to_save"
                and is_output_head(name)
            ):  # a head left out, tied
                problems[-1] += _UNTIE
            continue
        if name in merged:
            biases.append(found[0])
            continue
        key, base_t = found
        check_whole(key, base_t)
        shared = viewers[id(base_t.storage)] > 1
        if why == "modules_to_save" and id(base_t.storage) in merged_into and not shared:
            # The one weight a left-out tied head merges into; with both keys saved, the
            # copy is untied below and the other key keeps the merge, as PEFT unties them.
            _refuse_tied_head(key, aligned, lora)
        if why == "modules_to_save" and not lora.config.get("ensure_weight_tying"):
            _refuse_untied_embedding(key, tied_head(key, config))
        if shared and why == "modules_to_save":
            own = saved_storage(base_t.storage, base_t.dtype, base_t.numel)
            base_t = saved_tensor(base_t, own, base_t.dtype)
            untied[key] = base_t
        overrides[id(base_t.storage)] = replace_record(lora.ckpt, saved, base_t, why)
        actions[key] = f"replace ({why})"
        (replaced if why == "modules_to_save" else biases).append(key)
    if problems:
        raise ConversionError(f"the adapter does not fit the base: {'; '.join(problems[:8])}")
    return tuple(replaced), tuple(biases), untied


def _addable(name: str, aligned: Mapping[str, tuple[str, TensorRef]]) -> bool:
    """Whether a saved module the base lacks can be added under its own name: no output
    head (tied by the config), and the base's keys are the adapter's names (a base saved
    under other names would hold it where the model class does not look)."""
    return not is_output_head(name) and all(k == n for n, (k, _) in aligned.items())


def _base_dtype(aligned: Mapping[str, tuple[str, TensorRef]], saved: TensorRef) -> str:
    """The dtype the model class builds a new module in: its weights', as loaded."""
    floats = Counter(t.dtype for _, t in aligned.values() if t.dtype in FLOATING)
    return floats.most_common(1)[0][0] if floats else saved.dtype


def _refuse_tied_head(
    key: str, aligned: Mapping[str, tuple[str, TensorRef]], lora: LoraAdapter
) -> None:
    """Refuse a ``modules_to_save`` copy of the weight a left-out tied head merges into.

    PEFT gives the head its own weight (the base's plus the delta) apart from the trained
    copy; a state dict with one weight for both, tied by config.json, cannot hold both.
    """
    heads = [t.module for t in lora.targets if f"{t.module}.weight" not in aligned]
    raise ConversionError(
        f"{key} is replaced by its modules_to_save copy, but {', '.join(heads) or 'a target'} "
        "is tied to it (left out of the base, tied by config.json's tie_word_embeddings) and "
        "its LoRA delta merges into the same weight: PEFT unties them, and merging here would "
        f"lose the delta. Save the base untied (tie_word_embeddings false, with "
        f"{heads[0] if heads else 'the head'}.weight written) and merge that"
    )


def _refuse_untied_embedding(key: str, architecture: str | None) -> None:
    """Refuse a ``modules_to_save`` copy of an input embedding config.json ties a head to.

    PEFT swaps in the trained copy and the head keeps the base's embedding (it warns that
    this complicates merging); a folder whose config.json ties the two cannot hold both.
    """
    if architecture is not None:
        raise ConversionError(
            f"{key} is replaced by its modules_to_save copy, but config.json ties "
            f"{architecture}'s output head to it (tie_word_embeddings): PEFT unties them, the "
            "head keeping the base's embedding, which a folder tied by config.json cannot "
            "hold. Train with LoraConfig(ensure_weight_tying=True), which trains one copy for "
            "both, or save the base untied (tie_word_embeddings false, the head's weight "
            "written) and merge that"
        )


def _tied_copy(name: str, lora: LoraAdapter) -> bool:
    """Whether ``name`` is saved only as a tied module's copy (``ensure_weight_tying``)."""
    names = saved_module_names(lora.config)
    return bool(lora.config.get("ensure_weight_tying")) and not is_saved(
        name.rsplit(".", 1)[0], names
    )
