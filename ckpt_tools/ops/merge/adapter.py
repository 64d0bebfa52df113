"""A PEFT LoRA adapter folder read as data: its config, and one target per adapted module.

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or a pickled
``adapter_model.bin``, read by the restricted reader, never unpickled with code). PEFT saves
each tensor as ``base_model.model.<module>.<part>`` with the adapter's name removed; the
module's rank and alpha come from ``rank_pattern`` / ``alpha_pattern`` as PEFT resolves them.
Trained biases (``bias="lora_only"`` or ``"all"``) are saved as the base model's own tensors,
``<target>.base_layer.bias`` or ``<module>.bias``, which loading puts in place of the base's.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import CheckpointNotFoundError, ConversionError, CorruptCheckpointError
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.formats.missing import dangling
from ckpt_tools.ops.merge.config_checks import (
    check_config_targets,
    check_config_values,
    rank_alpha,
)
from ckpt_tools.ops.merge.saved import modules_to_save, trained_biases
from ckpt_tools.structure.wrappers import LORA_PARTS

__all__ = [
    "CONFIG_NAME",
    "WEIGHT_NAMES",
    "LoraAdapter",
    "LoraTarget",
    "is_adapter_folder",
    "read_adapter",
    "read_config",
    "target_modules",
]

CONFIG_NAME = "adapter_config.json"
WEIGHT_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
_PREFIX = "base_model.model."
# PEFT's parts of a LoRA module, as saved, and what each is to the merge.
_PARTS = dict(zip(LORA_PARTS, ("A", "B", "bias", "A", "B", "magnitude")))
_PART_RE = re.compile(r"^(?P<module>.+)\.(?P<part>" + "|".join(map(re.escape, _PARTS)) + ")$")
# Config fields that, set, change what PEFT's merge computes (or make it refuse to merge),
# which this merge does not do: PEFT 0.21's LoRA variants and options, checked in its code.
_UNSUPPORTED_FIELDS = {
    "trainable_token_indices": "its token rows are merged apart from LoRA",
    "target_parameters": "LoRA on bare parameters is merged apart from modules",
    "use_qalora": "PEFT does not merge QALoRA",
    "alora_invocation_tokens": "PEFT does not merge aLoRA (activated LoRA)",
    "arrow_config": "PEFT does not merge an Arrow router",
    "use_bdlora": "BD-LoRA's delta is block-diagonal",
    "kasa_config": "KaSA truncates the base weight and scales B by a learned diagonal",
    "layer_replication": "replicated layers each merge into one shared base layer",
}
# init_lora_weights values whose initialisation, run again when PEFT loads the adapter,
# rewrites the base weight before the merge (a residual model is expected as the base).
_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")
_FLOATING = ("float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class LoraTarget:
    """One adapted module: its tensors in the adapter, its rank, alpha and scaling.

    Attributes:
        module: the module's path in the base model (``model.layers.0.self_attn.q_proj``).
        kind: ``linear`` (``lora_A`` / ``lora_B``), ``convolution`` (their kernels) or
            ``embedding`` (``lora_embedding_*``).
        a, b: the adapter's ``A`` ``(r, in)`` and ``B`` ``(out, r)`` tensors; a convolution's
            ``(r, in, *kernel)`` and ``(out, r, 1, ...)``.
        bias: ``lora_B.bias`` (``lora_bias=True``), or None.
        magnitude: DoRA's magnitude vector, or None (plain LoRA).
        r, alpha: the module's rank and alpha after ``rank_pattern`` / ``alpha_pattern``.
        scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA.
        rounds_delta: a plain merge rounds the delta to the weight's dtype before adding it,
            as PEFT's Embedding and its MiCA variant (``init_lora_weights="mica"``) do.
    """

    module: str
    kind: str
    a: TensorRef
    b: TensorRef
    bias: TensorRef | None
    magnitude: TensorRef | None
    r: int
    alpha: float
    scaling: float
    rounds_delta: bool = False


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter folder read as data.

    Attributes:
        path: the folder.
        weights: its weight file (``adapter_model.safetensors`` or ``.bin``).
        config: ``adapter_config.json`` as parsed.
        ckpt: the weight file, opened by the reader.
        targets: one per adapted module, in the file's order.
        modules_to_save: base key (module path and parameter) -> the adapter's full copy.
        base_layers: module -> the base weight saved with the adapter (PEFT saves a targeted
            embedding's weight, ``save_embedding_layers``); the merge starts from it.
        biases: base key (``<module>.bias``) -> the trained bias saved with ``bias="lora_only"``
            or ``"all"``, which replaces the base's (a ``lora_bias`` merge starts from it).
    """

    path: str
    weights: str
    config: Mapping[str, Any]
    ckpt: Checkpoint
    targets: tuple[LoraTarget, ...]
    modules_to_save: Mapping[str, TensorRef] = field(default_factory=dict)
    base_layers: Mapping[str, TensorRef] = field(default_factory=dict)
    biases: Mapping[str, TensorRef] = field(default_factory=dict)

    @property
    def peft_type(self) -> str:
        """PEFT's adapter type (``LORA``)."""
        return str(self.config.get("peft_type", "LORA"))

    @property
    def base_model(self) -> str | None:
        """``base_model_name_or_path`` as saved."""
        return self.config.get("base_model_name_or_path")

    @property
    def parameters(self) -> int:
        """Elements of every tensor the adapter holds."""
        return sum(t.numel for t in _tensors(self.ckpt.root).values())


def is_adapter_folder(path: str) -> bool:
    """Whether ``path`` is a folder holding an ``adapter_config.json``.

    Example:
        >>> is_adapter_folder("model.pt")
        False
    """
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_NAME))


def read_adapter(path: str, allow_globals: Sequence[str] = ()) -> LoraAdapter:
    """Read a PEFT LoRA adapter folder: its config, and each adapted module's tensors.

    Args:
        path: the folder holding ``adapter_config.json`` and ``adapter_model.*``.
        allow_globals: globals outside the allowlist a pickled ``adapter_model.bin`` may name.

    Returns:
        The :class:`LoraAdapter`.

    Raises:
        CheckpointNotFoundError: no ``adapter_config.json`` or weight file.
        ConversionError: an adapter type other than LoRA, a config field that changes the
            merge in a way this merge does not compute, a target's bias saved under a name
            PEFT no longer loads, or a key it does not know (exit 7).
        UnsafeContentError: a pickled weight file names a global outside the allowlist.

    Example:
        >>> read_adapter("lora").targets[0].module
        'head'
    """
    config = read_config(path)
    peft_type = str(config.get("peft_type") or "")
    if peft_type != "LORA":
        kind = f"an {peft_type}" if peft_type[:1] in tuple("AEIOU") else f"a {peft_type}"
        raise ConversionError(
            f"{path!r} is {kind if peft_type else 'an untyped'} adapter; merge-lora merges "
            "LoRA adapters (DoRA and rsLoRA included)"
        )
    _check_variant(path, config)
    check_config_values(path, config)
    weights = next((os.path.join(path, n) for n in WEIGHT_NAMES if _exists(path, n)), None)
    if weights is None:
        nothing = dangling(path, WEIGHT_NAMES)  # a link whose file never arrived, named
        raise nothing or CheckpointNotFoundError(f"{path!r} holds no {' or '.join(WEIGHT_NAMES)}")
    ckpt = open_checkpoint(weights)
    _check_globals(ckpt, allow_globals)
    tensors = {_unprefixed(k): v for k, v in _tensors(ckpt.root).items()}
    targets, rest = _targets(tensors, config, weights)
    check_config_targets(weights, config, {t.module: t.magnitude is not None for t in targets})
    modules = {t.module for t in targets}
    base_layers = {
        k[: -len(".base_layer.weight")]: rest.pop(k)
        for k in list(rest)
        if k.endswith(".base_layer.weight") and k[: -len(".base_layer.weight")] in modules
    }
    biases = trained_biases(rest, modules, config, weights)
    saved = modules_to_save(rest, config, weights)
    return LoraAdapter(path, weights, config, ckpt, tuple(targets), saved, base_layers, biases)


def _check_variant(path: str, config: Mapping[str, Any]) -> None:
    """Refuse an adapter whose config sets a field that changes or forbids PEFT's merge."""
    for name, why in _UNSUPPORTED_FIELDS.items():
        if config.get(name):
            raise ConversionError(
                f"{path!r}: adapter_config.json sets {name} ({config[name]!r}); {why}, "
                "and merge-lora merges plain LoRA, rsLoRA and DoRA only"
            )
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_REWRITING_INITS):
        raise ConversionError(
            f"{path!r}: adapter_config.json sets init_lora_weights={init!r}, which PEFT runs "
            "again on loading, rewriting the base weight; merge-lora does not. Save the "
            "adapter converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion)"
        )


def _exists(folder: str, name: str) -> bool:
    return os.path.isfile(os.path.join(folder, name))


def read_config(path: str) -> dict[str, Any]:
    """``adapter_config.json`` of the folder ``path``, as a dict.

    Raises:
        CheckpointNotFoundError: no config there.
        CorruptCheckpointError: it is not a JSON object.
    """
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        nothing = dangling(path, (CONFIG_NAME,))
        raise nothing or CheckpointNotFoundError(
            f"{path!r} is not an adapter folder: no {CONFIG_NAME}"
        )
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{config_path!r} is not JSON: {e}") from e
    if not isinstance(config, dict):
        raise CorruptCheckpointError(f"{config_path!r} holds no JSON object")
    return config


def target_modules(keys: Iterable[str]) -> tuple[str, ...]:
    """The modules whose LoRA parts ``keys`` name, once each, in order (any adapter type's
    keys may be given: only LoRA's parts count).

    Example:
        >>> target_modules(["base_model.model.fc.lora_A.weight", "fc.lora_B.weight", "x.bias"])
        ('fc',)
    """
    found = (_PART_RE.match(_unprefixed(k)) for k in keys)
    return tuple(dict.fromkeys(m.group("module") for m in found if m is not None))


def _check_globals(ckpt: Checkpoint, allow_globals: Sequence[str]) -> None:
    from ckpt_tools.ops.preflight import check_rewritable

    check_rewritable(ckpt, allow_globals)


def _tensors(root: Any) -> dict[str, TensorRef]:
    if not isinstance(root, Mapping):
        raise CorruptCheckpointError("an adapter's weight file holds a state dict")
    return {str(k): v for k, v in root.items() if isinstance(v, TensorRef)}


def _unprefixed(key: str) -> str:
    return key[len(_PREFIX) :] if key.startswith(_PREFIX) else key


def _targets(
    tensors: Mapping[str, TensorRef], config: Mapping[str, Any], weights: str
) -> tuple[list[LoraTarget], dict[str, TensorRef]]:
    """One target per module with LoRA parts; the other tensors returned as they are."""
    parts: dict[str, dict[str, tuple[str, TensorRef]]] = {}
    rest: dict[str, TensorRef] = {}
    for key, t in tensors.items():
        m = _PART_RE.match(key)
        if m is None:
            rest[key] = t
            continue
        part = m.group("part")
        parts.setdefault(m.group("module"), {})[_PARTS[part]] = (part, t)
    targets = []
    for module, found in parts.items():
        if "A" not in found or "B" not in found:
            missing = "A" if "A" not in found else "B"
            raise ConversionError(f"{weights!r}: {module!r} has no lora_{missing}")
        r, alpha, scaling = rank_alpha(config, module)
        a, b = found["A"][1], found["B"][1]
        kind = _kind(found["A"][0], a, b, r, f"{weights!r}: {module!r}")
        bias = found.get("bias", (None, None))[1]
        magnitude = found.get("magnitude", (None, None))[1]
        out = (b.shape[0],)
        # DoRA on a convolution keeps its magnitude as (1, out, 1, ...), one per output.
        spread = (1, *out, *(1,) * (len(b.shape) - 2)) if kind == "convolution" else out
        for name, t, shape in (
            ("lora_B.bias", bias, out),
            ("lora_magnitude_vector", magnitude, spread),
        ):
            if t is not None and (t.shape != shape or t.dtype not in _FLOATING):
                raise ConversionError(
                    f"{weights!r}: {module}.{name} is {t.dtype} {list(t.shape)}, not one "
                    f"floating value per output ({b.shape[0]})"
                )
        # PEFT's MiCA variant (linear and embedding layers) adds delta.to(weight.dtype).
        rounds = kind == "embedding" or (
            kind == "linear" and config.get("init_lora_weights") == "mica"  # (as PEFT: exactly)
        )
        targets.append(
            LoraTarget(module, kind, a, b, bias, magnitude, r, alpha, scaling, rounds_delta=rounds)
        )
    return targets, rest


def _kind(part: str, a: TensorRef, b: TensorRef, r: int, named: str) -> str:
    """``linear``, ``embedding`` or ``convolution``, from the parts' names and shapes.

    A convolution's A is a kernel ``(r, in, *k)`` and its B a 1-wide one ``(out, r, 1, ...)``.

    Raises:
        ConversionError: parts of no rank-``r`` layer that merges: B of a grouped convolution
            (``r / groups`` inputs), which PEFT does not merge, named as such.
    """
    kind = "embedding" if part.startswith("lora_embedding") else "linear"
    if kind == "linear" and len(a.shape) in (3, 4, 5):
        kind = "convolution"
    dims = 2 if kind != "convolution" else len(a.shape)
    floating = all(t.dtype in _FLOATING for t in (a, b))
    ones = all(n == 1 for n in b.shape[2:])
    if floating and len(a.shape) == len(b.shape) == dims and a.shape[0] == r and ones:
        if b.shape[1] == r:
            return kind
        if kind == "convolution" and b.shape[1] and r % b.shape[1] == 0:
            raise ConversionError(
                f"{named} is LoRA on a grouped convolution (groups={r // b.shape[1]}), "
                "which PEFT does not merge"
            )
    shapes = f"A {list(a.shape)}, B {list(b.shape)}"
    saved = a.shape[0] if len(a.shape) == len(b.shape) == dims and ones else None
    if floating and saved is not None and b.shape[1] == saved != r:
        # As PEFT's load says it (a size mismatch): the config and the weights disagree.
        raise ConversionError(
            f"{named}: the weights have rank {saved} ({shapes}), where the adapter's config "
            f"gives rank {r} (r, or its rank_pattern entry); PEFT refuses them too"
        )
    raise ConversionError(
        f"{named} is not a rank-{r} {kind} adapter ({shapes}); "
        "only Linear, Conv1D, convolution and Embedding targets are merged"
    )
