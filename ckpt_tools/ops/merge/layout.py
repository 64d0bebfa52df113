"""Where each LoRA target merges: a weight's layout (Linear or GPT-2 ``Conv1D``), and the
input embedding a tied output head's weight lives in.

PEFT decides per module from the module's class (``Conv1D`` merges ``(B @ A).T``). While it
injects the adapter it sets the config's ``fan_in_fan_out`` to each target's kind in turn, and
saves the last value, so the saved flag says only what the last target was. A weight whose
shape is not square says its layout itself; a square one is settled by the base's
``config.json``, by the names transformers gives its ``Conv1D`` modules, or by the caller.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import ConversionError, KeyCollisionError, Remedy
from ckpt_tools.io.writers.safetensors_checks import is_output_head
from ckpt_tools.ops.merge.adapter import LoraAdapter, LoraTarget
from ckpt_tools.structure.keys import plan_renames
from ckpt_tools.structure.wrappers import strip_wrapper_rules

__all__ = [
    "CONV1D_MODULES",
    "aligned_names",
    "base_config",
    "conv1d_layouts",
    "tied_embedding",
    "tied_head",
]

#: model_type -> the modules transformers builds as ``pytorch_utils.Conv1D`` (by last name);
#: every other model transformers builds uses ``nn.Linear`` for its projections.
CONV1D_MODULES: Mapping[str, frozenset[str]] = {
    "gpt2": frozenset({"c_attn", "q_attn", "c_proj", "c_fc"}),
    "decision_transformer": frozenset({"c_attn", "q_attn", "c_proj", "c_fc"}),
    "imagegpt": frozenset({"c_attn", "q_attn", "c_proj", "c_fc"}),
    "openai-gpt": frozenset({"c_attn", "c_proj", "c_fc"}),
    "clvp": frozenset({"c_proj", "c_fc"}),
    "clvp_decoder": frozenset({"c_proj", "c_fc"}),
}
_CONV1D_NAMES = frozenset().union(*CONV1D_MODULES.values())
# Input embeddings an output head is tied to, by the names transformers gives them.
_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "shared", "embed_in", "tok_embeddings")
# Architectures with an output head transformers ties to the input embeddings.
_HEADED = re.compile(
    r"(ForCausalLM|ForMaskedLM|ForConditionalGeneration|LMHeadModel|ForPreTraining)$"
)
_HF_WEIGHTS = re.compile(
    r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$"
)


def base_config(base: str) -> dict[str, Any] | None:
    """The base's ``config.json``: in an HF folder, or beside an HF weight file; else None.

    Example:
        >>> base_config("model.pt") is None
        True
    """
    if os.path.isdir(base):
        path = os.path.join(base, "config.json")
    elif _HF_WEIGHTS.match(os.path.basename(base)):
        path = os.path.join(os.path.dirname(base), "config.json")
    else:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # no config, or one we cannot read: decide without it
        return None
    return config if isinstance(config, dict) else None


def conv1d_layouts(
    found: Sequence[tuple[LoraTarget, TensorRef]],
    adapter_config: Mapping[str, Any],
    config: Mapping[str, Any] | None,
    fan_in_fan_out: bool | None,
) -> dict[str, bool]:
    """Whether each Linear-kind target's weight is a ``Conv1D`` (its delta transposed).

    Args:
        found: each ``linear`` target with the base weight it merges into (shapes checked by
            the caller: the weight is ``(out, in)`` or ``(in, out)``).
        adapter_config: ``adapter_config.json``, whose ``fan_in_fan_out`` is the last
            target's kind.
        config: the base's ``config.json``, or None.
        fan_in_fan_out: the caller's word for square weights nothing else settles.

    Returns:
        module -> True for ``Conv1D``.

    Raises:
        ConversionError: square weights whose layout nothing settles, all named.
    """
    saved = bool(adapter_config.get("fan_in_fan_out"))
    told = {t.module: weight.shape != (t.b.shape[0], t.a.shape[1]) for t, weight in found}
    square = {t.module for t, _ in found if t.b.shape[0] == t.a.shape[1]}
    # A non-square target of the other kind than the saved flag: the targets are mixed.
    mixed = any(told[m] != saved for m in told if m not in square)
    ambiguous = []
    for module in square:
        by_type = _by_model_type(module, config)
        if by_type is not None:
            told[module] = by_type
        elif fan_in_fan_out is not None:
            told[module] = fan_in_fan_out
        elif mixed or (module.rsplit(".", 1)[-1] in _CONV1D_NAMES) != saved:
            ambiguous.append(module)
        else:
            told[module] = saved
    if ambiguous:
        raise ConversionError(
            f"square weights whose layout is unknown: {', '.join(sorted(ambiguous)[:8])}; the "
            f"adapter's saved fan_in_fan_out ({saved}) is its last target's, and the base has "
            "no config.json model_type that tells a Conv1D (GPT-2) from a Linear",
            remedies=(
                Remedy("fan_in_fan_out", "True", flag="--fan-in-fan-out", text="for Conv1D"),
                Remedy("fan_in_fan_out", "False", flag="--no-fan-in-fan-out", text="for Linear"),
            ),
        )
    return told


def _sub_model(module: str, config: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    """The model a module lies in, for a composite one (``VisionEncoderDecoderModel``,
    ``EncoderDecoderModel``: each part is a model of its own type, its config under the part's
    name): ``(prefix, module within it, its config)``.

    Example:
        >>> config = {"model_type": "vision-encoder-decoder", "decoder": {"model_type": "gpt2"}}
        >>> _sub_model("decoder.transformer.h.0.attn.c_proj", config)[::2]
        ('decoder.', {'model_type': 'gpt2'})
    """
    prefix = ""
    head, _, rest = module.partition(".")
    while rest and isinstance(config.get(head), Mapping) and "model_type" in config[head]:
        prefix, module, config = f"{prefix}{head}.", rest, config[head]
        head, _, rest = module.partition(".")
    return prefix, module, config


def _by_model_type(module: str, config: Mapping[str, Any] | None) -> bool | None:
    """A module's kind as transformers builds the base's ``model_type`` (the part's, in a
    composite model), or None if unknown.

    Remote code (``auto_map``) may build any module as it likes, so it tells nothing.
    """
    if config is None or "auto_map" in config:
        return None
    _, module, config = _sub_model(module, config)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return None
    return module.rsplit(".", 1)[-1] in CONV1D_MODULES.get(model_type, frozenset())


def aligned_names(sd: Mapping[Any, Any], lora: LoraAdapter) -> dict[str, tuple[str, TensorRef]]:
    """Base tensors by the adapter's names for them: (key as saved, tensor).

    The base's keys as saved, then with its wrapper prefixes stripped one more at a time
    (``module.``, then ``model.``), then with a model's prefix added (the Hub's ``gpt2``
    saves ``h.0.attn.c_attn.weight``, which transformers loads under the ``transformer.``
    its heads' classes add, and PEFT names so): the first view that holds every name the
    adapter needs wins, else the one that holds the most. Stripping everything at once would
    misalign a Hugging Face model whose keys all start with ``model.`` (tied embeddings, no
    ``lm_head``).
    """
    keys = [k for k in sd if isinstance(k, str)]
    tensors = {k: v for k, v in sd.items() if isinstance(k, str) and isinstance(v, TensorRef)}
    wanted = [f"{t.module}.weight" for t in lora.targets]
    wanted += [*lora.modules_to_save, *lora.biases]
    best: dict[str, tuple[str, TensorRef]] = {}
    best_found = -1
    for plan in _views(sd, keys, wanted):
        view = {plan[k]: (k, v) for k, v in tensors.items()}
        found = sum(name in view for name in wanted)
        if found == len(wanted):
            return view
        if found > best_found:
            best, best_found = view, found
    return best


def _views(
    sd: Mapping[Any, Any], keys: list[str], wanted: list[str]
) -> Iterator[Mapping[str, str]]:
    """The namings :func:`aligned_names` tries, in order, each planned only when reached: as
    saved, then one more wrapper prefix stripped at a time, then a prefix the adapter's names
    share added (transformers' ``base_model_prefix``)."""
    yield {k: k for k in keys}
    rules, _ = strip_wrapper_rules(sd)
    for n in range(1, len(rules) + 1):
        try:
            yield plan_renames(keys, rules[:n])
        except KeyCollisionError:  # a view in which two keys are one cannot be used
            continue
    for head in sorted({name.split(".", 1)[0] for name in wanted if "." in name}):
        if not any(k.startswith(f"{head}.") for k in keys):
            yield {k: f"{head}.{k}" for k in keys}


def tied_embedding(
    target: LoraTarget,
    aligned: Mapping[str, tuple[str, TensorRef]],
    config: Mapping[str, Any] | None,
) -> tuple[tuple[str, TensorRef] | None, str]:
    """The input embedding a target missing from the base is tied to, or why none is used.

    ``save_pretrained`` leaves a tied output head out; transformers ties it to the input
    embedding, and PEFT then merges the head's delta into that one weight.

    Returns:
        ``((key, tensor), "")``, or ``(None, problem)``.
    """
    name = f"{target.module}.weight"
    if not (is_output_head(name) or target.module.rsplit(".", 1)[-1] in _EMBEDDINGS):
        return None, f"{name} (missing from the base)"  # no module transformers ties
    # The part's own config in a composite model (a decoder ties its head, the whole does
    # not). transformers writes the key only where it differs from its default, True
    # (GPT-2's config.json has none): absent, the head is tied.
    prefix, _, config = _sub_model(target.module, config) if config is not None else ("", "", None)
    if config is None or config.get("tie_word_embeddings", True) is not True:
        return None, f"{name} (missing from the base)"
    # The weight's shape: (out, in) for a Linear; (rows, width) for an Embedding, whose A
    # is (r, rows) and B (width, r) (T5's encoder and decoder embed_tokens, tied to shared).
    if target.kind == "embedding":
        shape = (target.a.shape[1], target.b.shape[0])
    else:
        shape = (target.b.shape[0], target.a.shape[1])
    found = [
        v
        for k, v in aligned.items()
        if k.startswith(prefix)
        and k.endswith(".weight")
        and k[: -len(".weight")].rsplit(".", 1)[-1] in _EMBEDDINGS
        and v[1].shape == shape
    ]
    if target.kind not in ("linear", "embedding") or len(found) != 1:
        seen = ", ".join(k for k, _ in found) or "none of its shape"
        return None, (
            f"{name} (tied to the input embeddings by config.json's tie_word_embeddings, "
            f"which could not be told: {seen})"
        )
    return found[0], ""


def tied_head(key: str, config: Mapping[str, Any] | None) -> str | None:
    """The architecture whose output head config.json ties to the input embedding ``key``
    (``model.embed_tokens.weight``), or None: no config, no tie, no head, another weight.

    Example:
        >>> tied = {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}
        >>> tied_head("model.embed_tokens.weight", tied), tied_head("model.norm.weight", tied)
        ('LlamaForCausalLM', None)
    """
    if config is None or not key.endswith(".weight"):
        return None
    prefix, module, config = _sub_model(key[: -len(".weight")], config)
    if prefix:  # a part of a composite model: its config's architectures are not its role
        return None
    if (
        module.rsplit(".", 1)[-1] not in _EMBEDDINGS
        or config.get("tie_word_embeddings", True) is not True
    ):
        return None
    names = config.get("architectures")
    headed = (
        [a for a in names if isinstance(a, str) and _HEADED.search(a)]
        if isinstance(names, list)
        else []
    )
    return headed[0] if headed else None
