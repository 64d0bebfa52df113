"""Which entry of a checkpoint is the model's state dict, and how a dotted path reaches it.

Training code nests the weights in many ways: a plain state dict, ``{"state_dict": ...}``,
``{"model": ...}``, Lightning checkpoints, trainer dicts with optimizer state beside the
model, EMA copies. :func:`select_state_dict` picks one and says why; ``select`` overrides it.

``select`` is a path as :mod:`ckpt_tools.structure.paths` reads it, the same for every caller;
its walker and replacer are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_tools._escape import shown
from ckpt_tools._types import Select
from ckpt_tools.descriptors import Opaque, Reduced, TensorRef
from ckpt_tools.errors import SelectError
from ckpt_tools.structure.modules import RecoveredModule, recover_module
from ckpt_tools.structure.path_replace import replace_at
from ckpt_tools.structure.paths import (
    PathWalk,
    attributes_of,
    entries_beside,
    is_tensor,
    key_text,
    mapping_at,
    parse_select,
    resolve_path,
    walk_path,
)
from ckpt_tools.structure.tensor_walk import holding_containers

__all__ = [
    "CANDIDATE_KEYS",
    "PathWalk",
    "Selection",
    "a_kind_of",
    "attributes_of",
    "counts_as_tensor",
    "entries_beside",
    "holds_no_state_dict",
    "is_state_dict",
    "key_text",
    "mapping_at",
    "parse_select",
    "replace_at",
    "resolve_path",
    "select_state_dict",
    "unbuilt_holders",
    "walk_path",
]

# Looked for in this order: the live model before its EMA copy.
CANDIDATE_KEYS: tuple[str, ...] = (
    "state_dict",
    "model_state_dict",
    "model_state",
    "model",
    "module",
    "net",
    "network",
    "weights",
    "params",
    "state_dict_ema",
    "model_ema",
    "ema",
)
_LIGHTNING_MARKERS = ("pytorch-lightning_version", "optimizer_states", "global_step")
# How many entries deep the automatic choice looks (``model.model.state_dict`` is three). A
# pickle nests as deep as it likes; a state dict below this is picked with ``select``.
MAX_SEARCH_DEPTH = 64


@dataclass(frozen=True)
class Selection:
    """The chosen state dict.

    Attributes:
        path: keys leading to it from the root (``("state_dict",)``; ``()`` for the root).
        reason: why it was chosen, in words.
        state_dict: the chosen mapping.
        module: when the entry is a pickled ``nn.Module`` (``torch.save(model)``), what
            was recovered from it; ``state_dict`` is then its recovered state dict.
        stand_in: the root is no mapping (a bare tensor, a list, None) and ``state_dict`` an
            empty stand-in for it: what is written back must be the root, not the stand-in.
        found: whether ``state_dict`` is a state dict, empty ones included (an empty root, an
            empty dict under a state dict's name, a module without parameters); False where
            nothing looked like one and the root is shown.
        passed_over: the other tensor dicts beside the chosen one, when the largest of several
            was taken (dotted paths: a GAN's ``model.discriminator``).
    """

    path: tuple[str, ...]
    reason: str
    state_dict: Mapping[str, Any]
    module: RecoveredModule | None = None
    stand_in: bool = False
    found: bool = True
    passed_over: tuple[str, ...] = ()


def a_kind_of(value: Any) -> str:
    """What a checkpoint's root (or any node) is, in words, for messages.

    Example:
        >>> a_kind_of([1]), a_kind_of(None)
        ('a list', 'None')
    """
    if value is None:
        return "None"
    # A class the pickle names is the checkpoint's text: escaped as names are.
    return "a tensor" if isinstance(value, TensorRef) else f"a {shown(type(value).__name__)}"


def unbuilt_holders(root: Mapping[Any, Any]) -> list[Any]:
    """The keys of ``root``'s entries that are objects of classes the reader never builds
    (:class:`~ckpt_tools.descriptors.Opaque`: a dict subclass of the training script's) and
    hold tensors: each may be the state dict, which only the built object shows.

    Example:
        >>> unbuilt_holders({"epoch": 1})
        []
    """
    held = holding_containers(root)
    return [k for k, v in root.items() if isinstance(v, Opaque) and id(v) in held]


def holds_no_state_dict(where: str, root: Any) -> str:
    """The words every refusal of a root that is no mapping (``Selection.stand_in``) starts with.

    Example:
        >>> holds_no_state_dict("'t.pt'", [1])
        "'t.pt' holds a list, not a state dict (a mapping of names to tensors)"
    """
    return f"{where} holds {a_kind_of(root)}, not a state dict (a mapping of names to tensors)"


# How torch.save records a tensor subclass (a DTensor of an FSDP2 state dict, ...), and a lazy
# module's parameters before their first forward: read or refused by the loaders as their
# classes are, but tensors when choosing the state dict.
_SUBCLASS_REBUILD = "torch._tensor._rebuild_from_type_v2"
UNINITIALIZED = frozenset(
    {"torch.nn.parameter.UninitializedParameter", "torch.nn.parameter.UninitializedBuffer"}
)


def counts_as_tensor(value: Any) -> bool:
    """A tensor, a tensor subclass's (a DTensor's) saved form, or a lazy module's parameter:
    an entry of a state dict, whatever the loaders make of its class."""
    if is_tensor(value):
        return True
    if isinstance(value, Reduced):
        return value.func.qualname == _SUBCLASS_REBUILD
    return isinstance(value, Opaque) and type(value).global_ref.qualname in UNINITIALIZED


def is_state_dict(value: Any) -> bool:
    """A mapping of string keys whose values are mostly tensors (extra states allowed)."""
    if not isinstance(value, Mapping) or not value:
        return False
    tensors = sum(1 for v in value.values() if counts_as_tensor(v))
    return tensors > 0 and tensors * 2 >= len(value) and all(isinstance(k, str) for k in value)


def select_state_dict(root: Any, *, select: Select = None) -> Selection:
    """Pick the model's state dict inside a checkpoint's object tree.

    Args:
        root: the checkpoint's root object.
        select: a dotted path (``"model.ema"``) or a tuple of keys overriding the choice.

    Returns:
        The :class:`Selection`. When nothing looks like a state dict, the root is returned
        with a reason saying so.

    Raises:
        SelectError: ``select`` names a missing entry or something that is not a mapping.

    Example:
        >>> from ckpt_tools.descriptors import TensorRef
        >>> select_state_dict({"epoch": 1, "state_dict": {"w": TensorRef.__new__(TensorRef)}}).path
        ('state_dict',)
    """
    parts = parse_select(select)
    if parts is not None:
        walk = resolve_path(root, parts)
        recovered = recover_module(walk.node)
        if recovered is not None:
            why = f"chosen with --select; {recovered.description}"
            return Selection(walk.keys, why, recovered.state_dict, recovered)
        node = mapping_at(walk.node)
        if node is None:
            raise SelectError(
                f"it is {a_kind_of(walk.node)}, not a mapping of tensors; pick a dict entry",
                argument="select",
                value=repr(".".join(parts)),
                flag="--select",
            )
        return Selection(walk.keys, "chosen with --select", node)
    return _auto_select(root)


def _auto_select(root: Any, memo: dict[int, Selection] | None = None, depth: int = 0) -> Selection:
    # A pickle can share one node under many keys at every level: without the memo (one
    # answer per node, by identity) ``{"model": x, "state_dict": x}`` nested 30 times would
    # take 2**30 calls. A node met again on its own path (a cycle) selects nothing.
    memo = {} if memo is None else memo
    key = id(root)
    if key in memo:
        return memo[key]
    if depth > MAX_SEARCH_DEPTH:
        return _NOTHING  # a pickle may nest any depth (torch reads it); select finds deeper ones
    memo[key] = _NOTHING
    memo[key] = found = _select_in(root, memo, depth)
    return found


def _nested(key: str, found: Selection) -> str:
    if found.module is not None and not found.path:
        return f"entry {key!r}: {found.reason}"
    return f"nested {found.reason}"


_NOTHING = Selection((), "no state dict found; showing the root", {}, found=False)


def _select_in(root: Any, memo: dict[int, Selection], depth: int) -> Selection:
    recovered = recover_module(root)
    if recovered is not None:
        return Selection((), recovered.description, recovered.state_dict, recovered)
    # A trainer's dict may hold a tensor beside its state dict ({"state_dict": sd,
    # "best_acc1": tensor}): half tensors, but the state dict is the entry.
    if is_state_dict(root) and not any(
        k in root and is_state_dict(root[k]) for k in CANDIDATE_KEYS
    ):
        return Selection((), "the root is a state dict", root)
    # An empty state dict under a candidate name (a model with no parameters yet) is chosen
    # only when nothing holds tensors: it is the state dict, not a reason to take the root.
    empty: Selection | None = None
    if isinstance(root, Mapping):
        lightning = "state_dict" in root and any(m in root for m in _LIGHTNING_MARKERS)
        for key in CANDIDATE_KEYS:
            if key not in root:
                continue
            if is_state_dict(root[key]):
                why = "Lightning checkpoint" if lightning and key == "state_dict" else "entry"
                return Selection((key,), f"{why} {key!r} holds the weights", root[key])
            if isinstance(root[key], Mapping) and not root[key]:
                empty = empty or Selection((key,), f"entry {key!r}, empty", root[key])
                continue
            found = _auto_select(root[key], memo, depth + 1)
            if found.path and not found.state_dict and found.module is None:
                empty = empty or Selection(
                    (key, *found.path), _nested(key, found), found.state_dict
                )
            elif found.path or found.module is not None:
                over = tuple(f"{key}.{p}" for p in found.passed_over)
                return Selection(
                    (key, *found.path),
                    _nested(key, found),
                    found.state_dict,
                    found.module,
                    passed_over=over,
                )
        dicts = [(k, v) for k, v in root.items() if is_state_dict(v)]
        if dicts:
            key, best = max(dicts, key=lambda kv: len(kv[1]))
            others = ", ".join(repr(k) for k, _ in dicts if k != key)
            why = f"the largest tensor dict {key!r}" + (
                f"; also {others}: select one to take it instead" if others else ""
            )
            over = tuple(str(k) for k, _ in dicts if k != key)
            return Selection((str(key),), why, best, passed_over=over)
        for key, value in root.items():
            recovered = recover_module(value) if isinstance(key, str) else None
            if recovered is not None:
                reason = f"entry {key!r}: {recovered.description}"
                return Selection((key,), reason, recovered.state_dict, recovered)
    if isinstance(root, Opaque) and isinstance(root.state, Mapping):
        inner = _auto_select(root.state, memo, depth + 1)
        if inner.path or is_state_dict(root.state):
            return inner
    if empty is not None:
        return empty
    if isinstance(root, Mapping):  # an empty root is an empty state dict (torch.load's {})
        return Selection((), "no state dict found; showing the root", root, found=not root)
    return Selection((), "no state dict found; showing the root", {}, stand_in=True, found=False)
