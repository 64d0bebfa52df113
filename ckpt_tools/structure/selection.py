"""Which entry of a checkpoint is the model's state dict.

Training code nests the weights in many ways: a plain state dict, ``{"state_dict": ...}``,
``{"model": ...}``, Lightning checkpoints, trainer dicts with optimizer state beside the
model, EMA copies. :func:`select_state_dict` picks one and says why; ``select`` overrides it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools.descriptors import Opaque, TensorRef
from ckpt_tools.errors import SelectError

__all__ = ["CANDIDATE_KEYS", "Selection", "is_state_dict", "parse_select", "select_state_dict"]

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


@dataclass(frozen=True)
class Selection:
    """The chosen state dict.

    Attributes:
        path: keys leading to it from the root (``("state_dict",)``; ``()`` for the root).
        reason: why it was chosen, in words.
        state_dict: the chosen mapping.
    """

    path: tuple[str, ...]
    reason: str
    state_dict: Mapping[str, Any]


def _is_tensor(value: Any) -> bool:
    # Real torch tensors count too (in-memory trees), checked by module: torch is not imported.
    return isinstance(value, TensorRef) or (
        type(value).__module__.startswith("torch") and hasattr(value, "dtype")
    )


def is_state_dict(value: Any) -> bool:
    """A mapping of string keys whose values are mostly tensors (extra states allowed)."""
    if not isinstance(value, Mapping) or not value:
        return False
    tensors = sum(1 for v in value.values() if _is_tensor(v))
    return tensors > 0 and tensors * 2 >= len(value) and all(isinstance(k, str) for k in value)


def parse_select(select: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``"a.b"`` -> ``("a", "b")``; a sequence is taken as is; None stays None."""
    if select is None:
        return None
    if isinstance(select, str):
        return tuple(part for part in select.split(".") if part) if select else ()
    return tuple(select)


def _walk(root: Any, parts: tuple[str, ...]) -> tuple[tuple[str, ...], Any]:
    # Keys may contain dots themselves: at each level take the longest run of parts that is
    # a key, so --select "model.ema" finds {"model.ema": ...} as well as {"model": {"ema": ...}}.
    node, path, i = root, [], 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            candidate = ".".join(parts[i:j])
            child = _child(node, candidate)
            if child is not _MISSING:
                node, i = child, j
                path.append(candidate)
                break
        else:
            available = _keys_of(node)
            raise SelectError(
                f"no entry {parts[i]!r} under {'.'.join(path) or 'the root'}; it has: "
                f"{', '.join(available[:12]) or 'nothing'}",
                argument="select",
                value=repr(".".join(parts)),
                flag="--select",
            )
    return tuple(path), node


_MISSING = object()


def _child(node: Any, key: str) -> Any:
    if isinstance(node, Mapping):
        if key in node:
            return node[key]
        if key.isdigit() and int(key) in node:
            return node[int(key)]
    elif isinstance(node, (list, tuple)) and key.isdigit() and int(key) < len(node):
        return node[int(key)]
    elif isinstance(node, Opaque) and isinstance(node.state, Mapping):
        return _child(node.state, key)
    return _MISSING


def _keys_of(node: Any) -> list[str]:
    if isinstance(node, Mapping):
        return [str(k) for k in node]
    if isinstance(node, (list, tuple)):
        return [str(i) for i in range(len(node))]
    return []


def select_state_dict(root: Any, select: str | Sequence[str] | None = None) -> Selection:
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
        >>> select_state_dict({"epoch": 1, "state_dict": {"w": TensorRef.__new__(TensorRef)}}).path
        ('state_dict',)
    """
    parts = parse_select(select)
    if parts is not None:
        path, node = _walk(root, parts)
        if isinstance(node, Opaque) and isinstance(node.state, Mapping):
            node = node.state
        if not isinstance(node, Mapping):
            raise SelectError(
                f"it is a {type(node).__name__}, not a mapping of tensors; pick a dict entry",
                argument="select",
                value=repr(".".join(parts)),
                flag="--select",
            )
        return Selection(path, "chosen with --select", node)
    return _auto_select(root)


def _auto_select(root: Any, memo: dict[int, Selection] | None = None) -> Selection:
    # A pickle can share one node under many keys at every level: without the memo (one
    # answer per node, by identity) ``{"model": x, "state_dict": x}`` nested 30 times would
    # take 2**30 calls. A node met again on its own path (a cycle) selects nothing.
    memo = {} if memo is None else memo
    key = id(root)
    if key in memo:
        return memo[key]
    memo[key] = _NOTHING
    memo[key] = found = _select_in(root, memo)
    return found


_NOTHING = Selection((), "no state dict found; showing the root", {})


def _select_in(root: Any, memo: dict[int, Selection]) -> Selection:
    if is_state_dict(root):
        return Selection((), "the root is a state dict", root)
    if isinstance(root, Mapping):
        lightning = "state_dict" in root and any(m in root for m in _LIGHTNING_MARKERS)
        for key in CANDIDATE_KEYS:
            if key not in root:
                continue
            if is_state_dict(root[key]):
                why = "Lightning checkpoint" if lightning and key == "state_dict" else "entry"
                return Selection((key,), f"{why} {key!r} holds the weights", root[key])
            found = _auto_select(root[key], memo)
            if found.path:
                return Selection((key, *found.path), f"nested {found.reason}", found.state_dict)
        best = max(
            ((k, v) for k, v in root.items() if is_state_dict(v)),
            key=lambda kv: len(kv[1]),
            default=None,
        )
        if best is not None:
            return Selection((str(best[0]),), f"the largest tensor dict {best[0]!r}", best[1])
    if isinstance(root, Opaque) and isinstance(root.state, Mapping):
        inner = _auto_select(root.state, memo)
        if inner.path or is_state_dict(root.state):
            return inner
    return Selection(
        (), "no state dict found; showing the root", root if isinstance(root, Mapping) else {}
    )
