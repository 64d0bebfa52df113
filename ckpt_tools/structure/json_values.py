"""Values made ready for strict JSON, which has no infinity and no NaN."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["json_ready"]


def json_ready(value: Any) -> Any:
    """``value`` with every float that is not finite written as its name, at any depth.

    JSON has no such numbers (``json.dumps`` writes ``Infinity``, which strict parsers
    refuse); ``"inf"``, ``"-inf"`` and ``"nan"`` are what ``float()`` reads back.

    Args:
        value: a number, string, mapping, list or tuple (of those, nested); other objects
            are returned as they are.

    Returns:
        The same value, mappings as dicts and tuples as lists where they hold anything.

    Example:
        >>> json_ready({"alpha": float("inf"), "losses": (0.5, float("nan"))})
        {'alpha': 'inf', 'losses': [0.5, 'nan']}
    """
    # A stack, not recursion: an index's metadata may nest as deep as its reader takes.
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]  # (value, its new parent, key)
    while stack:
        node, parent, key = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            parent[key] = str(node)
        elif isinstance(node, Mapping):
            parent[key] = made = dict.fromkeys(node)
            stack.extend((v, made, k) for k, v in node.items())
        elif isinstance(node, list | tuple):
            parent[key] = made = [None] * len(node)
            stack.extend((v, made, i) for i, v in enumerate(node))
        else:
            parent[key] = node
    return root[0]
