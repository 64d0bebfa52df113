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
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value
