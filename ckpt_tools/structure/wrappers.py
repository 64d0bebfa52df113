"""Training wrappers in state-dict keys: what each adds (:data:`WRAPPER_RULES`), which a set of
keys carries (:func:`detect_wrappers`), the rules that strip them, and the in-memory
:func:`strip_prefix` / :func:`add_prefix`.

``module.`` (DataParallel, DDP), ``_orig_mod.`` (``torch.compile``), FSDP and
activation-checkpoint segments, Lightning's and PEFT's attributes; the rules are
:class:`~ckpt_tools.structure.keys.KeyRule` s, applied by :mod:`ckpt_tools.structure.keys`.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools._escape import shell_word
from ckpt_tools._types import checked_flags
from ckpt_tools.errors import Remedy, ResourceLimitError, UsageError
from ckpt_tools.structure.keys import KeyRule, add_rule, rename_keys, strip_rule
from ckpt_tools.structure.selection import counts_as_tensor

__all__ = [
    "FILE_DEPENDENT_PREFIXES",
    "LORA_PARTS",
    "MAX_WRAPPER_DEPTH",
    "WRAPPER_RULES",
    "WrapperMatch",
    "WrapperRule",
    "add_prefix",
    "check_wrapper_prefix",
    "detect_wrappers",
    "file_wrapper_rules",
    "strip_prefix",
    "strip_wrapper_rules",
]


@dataclass(frozen=True)
class WrapperRule:
    """What one training wrapper adds to keys.

    Attributes:
        prefix: the text it adds, ending in ``.``.
        kind: who adds it, in words.
        inner: it may appear inside a key (``blocks.0._checkpoint_wrapped_module.fc``), not
            only at the start.
        whole: report it as a prefix only when every tensor key carries it (``module.`` and
            ``model.`` are also common plain attribute names; the wrapper prefixes every
            key, a top-level parameter's too). A non-tensor entry (an ``epoch`` beside the
            weights) does not count, where the keys come with their values.
        under: where it lies in a stack of wrappers: None, anywhere; else at the start of
            the keys or right under one of these, and once. Lightning's ``model.`` is a
            LightningModule's attribute, so it starts the keys of its state dict (or of
            Lightning's own wrapper of it, ``_forward_module.``): under ``module.``,
            ``_orig_mod.``, PEFT's ``base_model.model.`` or another ``model.``, it is the
            wrapped model's own attribute.
    """

    prefix: str
    kind: str
    inner: bool = False
    whole: bool = False
    under: tuple[str, ...] | None = None


WRAPPER_RULES: tuple[WrapperRule, ...] = (
    # DataParallel and DDP prefix every key; some keys under module. are an attribute of that
    # name (an EMA helper's self.module), which stripping would break.
    WrapperRule("module.", "nn.DataParallel / DistributedDataParallel", whole=True),
    WrapperRule("_orig_mod.", "torch.compile", inner=True),
    WrapperRule("_fsdp_wrapped_module.", "FullyShardedDataParallel", inner=True),
    WrapperRule("_checkpoint_wrapped_module.", "activation checkpoint_wrapper", inner=True),
    WrapperRule("_forward_module.", "Lightning Fabric / DeepSpeed _forward_module", inner=True),
    WrapperRule("base_model.model.", "PEFT PeftModel", whole=True),
    WrapperRule(
        "model.", "Lightning module attribute `model`", whole=True, under=("_forward_module.",)
    ),
)


#: The names PEFT gives a LoRA module's parts in a state dict, after the module's path
#: (embeddings' and DoRA's have no ``.weight``).
LORA_PARTS = (
    "lora_A.weight",
    "lora_B.weight",
    "lora_B.bias",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
)

#: The most wrapper prefixes :func:`detect_wrappers` peels from the start of keys. Training
#: wrappers stack a few; each layer costs a pass over every key and a rule in every rewrite.
MAX_WRAPPER_DEPTH = 32


@dataclass(frozen=True)
class WrapperMatch:
    """A wrapper found in a set of keys.

    Attributes:
        prefix: the wrapper's text (``module.``).
        kind: who adds it.
        count: keys that carry it.
        of: keys looked at.
        inner: found inside keys rather than at their start.
    """

    prefix: str
    kind: str
    count: int
    of: int
    inner: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "kind": self.kind,
            "count": self.count,
            "of": self.of,
            "inner": self.inner,
        }


@checked_flags
def detect_wrappers(
    keys: Iterable[str] | Mapping[Any, Any],
    *,
    wrappers: Sequence[WrapperRule] = WRAPPER_RULES,
    anywhere: bool = False,
) -> tuple[WrapperMatch, ...]:
    """Find the wrapper prefixes a set of state-dict keys carries, outermost first.

    Stacked wrappers are peeled one layer at a time (``module._orig_mod.fc.weight`` gives
    ``module.`` then ``_orig_mod.``). Wrappers that nest inside the tree (FSDP, activation
    checkpointing) are also counted where they appear inside keys.

    Args:
        keys: the tensor keys of a state dict; or the state dict itself, whose entries that
            are no tensor (an ``epoch`` saved inside it) are left out.
        wrappers: the wrappers to look for (a caller that knows a checkpoint is no Lightning
            one leaves out ``model.``).
        anywhere: peel a prefix that only starts a model's keys (Lightning's ``model.``)
            wherever and as often as it occurs: to line two sets of keys up, each peeled
            alike, rather than to name what to strip from one.

    Returns:
        The matches, outermost prefix first, then inner ones.

    Raises:
        ResourceLimitError: keys start with more than :data:`MAX_WRAPPER_DEPTH` wrappers.

    Example:
        >>> [m.prefix for m in detect_wrappers(["module._orig_mod.fc.weight"])]
        ['module.', '_orig_mod.']
    """
    if isinstance(keys, Mapping):  # (a DTensor of an FSDP2 state dict counts)
        keys = [k for k, v in keys.items() if counts_as_tensor(v)]
    current = [k for k in keys if isinstance(k, str)]
    total = len(current)
    found: list[WrapperMatch] = []
    peeled: set[str] = set()
    while current:
        for rule in wrappers:
            if not (anywhere or _may_follow(rule, found)):
                continue
            count = sum(k.startswith(rule.prefix) for k in current)
            # DataParallel and its kind prefix every tensor key, top-level parameters too.
            if count and (not rule.whole or count == len(current)):
                if len(found) == MAX_WRAPPER_DEPTH:
                    raise _too_deep(rule.prefix)
                found.append(WrapperMatch(rule.prefix, rule.kind, count, total))
                peeled.add(rule.prefix)
                current = [
                    k[len(rule.prefix) :] if k.startswith(rule.prefix) else k for k in current
                ]
                break
        else:
            break
    for rule in wrappers:
        if not rule.inner:
            continue
        count = sum(f".{rule.prefix}" in k for k in current)
        if count:
            found.append(WrapperMatch(rule.prefix, rule.kind, count, total, inner=True))
    return tuple(found)


def _may_follow(rule: WrapperRule, found: Sequence[WrapperMatch]) -> bool:
    """Whether ``rule`` may be the next prefix peeled after ``found`` (see ``under``)."""
    if rule.under is None:
        return True
    if any(m.prefix == rule.prefix for m in found):
        return False
    return not found or found[-1].prefix in rule.under


def _too_deep(prefix: str) -> ResourceLimitError:
    return ResourceLimitError(
        f"keys start with more than {MAX_WRAPPER_DEPTH} wrapper prefixes (the next is "
        f"{prefix!r}); training wrappers stack a few, so these are not a model's keys"
    )


def file_wrapper_rules(
    names: Iterable[str], *, path: str, fmt: str, metadata: Mapping[str, Any] | None
) -> tuple[WrapperRule, ...]:
    """The wrapper rules that apply to the keys (``names``) of the checkpoint file at ``path``.

    - Lightning's ``model.`` is left out where the checkpoint is a Hugging Face one: a
      folder (``fmt`` ``hf-sharded``), a safetensors file with the ``format`` metadata
      ``save_pretrained`` writes, or a file named as transformers names its weights
      (``pytorch_model.bin``, ``model-00001-of-00002.safetensors``). Lightning saves none of
      these, and a transformers model whose keys all lie under its own ``model`` attribute
      (tied embeddings leave no ``lm_head.weight``) loads only with them.
    - PEFT's ``base_model.model.`` is left out in an adapter (``adapter_model.safetensors``,
      or keys holding LoRA parts): an adapter's keys are the ones PEFT loads, whatever its
      kind (LoRA, IA3, LoHa ...), and no plain model has a ``lora_A``.

    Example:
        >>> rules = file_wrapper_rules([], path="adapter_model.bin", fmt="torch-zip", metadata={})
        >>> "base_model.model." in {r.prefix for r in rules}
        False
    """
    name = posixpath.basename(path.rstrip("/"))
    hf = fmt == "hf-sharded" or (fmt == "safetensors" and "format" in (metadata or {}))
    hf = hf or bool(_TRANSFORMERS_NAME.fullmatch(name))
    adapter = name.startswith("adapter_model") or any(n.endswith(LORA_PARTS) for n in names)
    lightning, peft = FILE_DEPENDENT_PREFIXES
    left_out = ({lightning} if hf else set()) | ({peft} if adapter else set())
    return tuple(rule for rule in WRAPPER_RULES if rule.prefix not in left_out)


#: The wrapper prefixes :func:`file_wrapper_rules` may leave out (Lightning's, PEFT's): a
#: command that strips them names them, so that it strips them whatever the file.
FILE_DEPENDENT_PREFIXES = ("model.", "base_model.model.")


# The weight files transformers, diffusers and PEFT write: whole, or one shard of an index.
_SHARD = r"(-\d+-of-\d+)?"
_TRANSFORMERS_NAME = re.compile(
    rf"(pytorch_model|diffusion_pytorch_model|adapter_model){_SHARD}\.bin"
    rf"|(model|diffusion_pytorch_model|adapter_model){_SHARD}\.safetensors"
)


def strip_wrapper_rules(
    keys: Iterable[str] | Mapping[Any, Any],
    *,
    anywhere: bool = False,
    wrappers: Sequence[WrapperRule] = WRAPPER_RULES,
) -> tuple[tuple[KeyRule, ...], tuple[WrapperMatch, ...]]:
    """The rules that strip every wrapper :func:`detect_wrappers` finds in ``keys``
    (``anywhere`` and ``wrappers`` as it takes them)."""
    matches = detect_wrappers(keys, wrappers=wrappers, anywhere=anywhere)
    rules = tuple(strip_rule(m.prefix, inner=m.inner) for m in matches)
    return rules, matches


def check_wrapper_prefix(prefix: object) -> str:
    """``prefix`` checked as a wrapper's prefix: a module path, so it ends with ``.``.

    Every training wrapper adds a whole module path (``module.``, ``_orig_mod.``); without
    the dot, adding ``module`` makes ``moduleweight`` and stripping it leaves ``.weight``.

    Args:
        prefix: the prefix :func:`strip_prefix` or :func:`add_prefix` (and ``strip_module``,
            ``add_module``) is given.

    Returns:
        ``prefix``, unchanged.

    Raises:
        UsageError: ``prefix`` is no str, or does not end with ``.``; the fix names the dotted
            prefix. A prefix map of any text is :func:`sub_rule`.

    Example:
        >>> check_wrapper_prefix("module")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: prefix='module': expected a module path ending with '.' ...
    """
    if isinstance(prefix, str) and prefix.endswith("."):
        return prefix
    dotted = f"{prefix}." if isinstance(prefix, str) and prefix else "module."
    if not isinstance(prefix, str):
        found = f"a {type(prefix).__name__}"
    else:
        found = "no '.' at its end" if prefix else "an empty prefix"
    raise UsageError(
        f"expected a module path ending with '.' (as every wrapper adds), found {found}",
        argument="prefix",
        value=repr(prefix),
        flag="--prefix",
        remedies=(Remedy("prefix", repr(dotted), flag=f"--prefix {shell_word(dotted)}"),),
    )


def strip_prefix(sd: Mapping[str, Any], *, prefix: str = "module.") -> dict:
    """Remove ``prefix`` from the keys that start with it (nn.DataParallel / DDP -> plain).

    Args:
        sd: a state dict (values are left as they are, tensors are not copied).
        prefix: the prefix to remove.

    Returns:
        A new dict of the same type, keys stripped, ``_metadata`` kept in step.

    Raises:
        KeyCollisionError: stripping would merge two keys.
        UsageError: ``prefix`` does not end with ``.`` (:func:`check_wrapper_prefix`).

    Example:
        >>> strip_prefix({"module.fc.weight": 0})
        {'fc.weight': 0}
    """
    return rename_keys(sd, [strip_rule(check_wrapper_prefix(prefix))])


def add_prefix(sd: Mapping[str, Any], *, prefix: str = "module.") -> dict:
    """Put ``prefix`` in front of every key (plain -> nn.DataParallel / DDP layout).

    ``_metadata`` gains the wrapper's own root entry, as a wrapped model's state dict has.

    Args:
        sd: a state dict (values are left as they are, tensors are not copied).
        prefix: the prefix to add.

    Returns:
        A new dict of the same type, keys prefixed.

    Raises:
        KeyCollisionError: never in practice (a prefix keeps distinct keys distinct); as
            :func:`rename_keys`.
        UsageError: ``prefix`` does not end with ``.`` (:func:`check_wrapper_prefix`).

    Example:
        >>> add_prefix({"fc.weight": 0})
        {'module.fc.weight': 0}
    """
    return rename_keys(sd, [add_rule(check_wrapper_prefix(prefix))])
