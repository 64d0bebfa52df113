"""A safetensors header's JSON, parsed as the crate's parser (serde_json) parses it.

Python's ``json`` takes more than serde_json: ``NaN``, repeated keys, ``-0`` as the integer
0, numbers too large for a float as integers or infinities. Each is refused here, or read as
serde reads it (``-0`` and an integer past 64 bits are floats to serde, so never a size or an
offset)."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["loads_header"]


def loads_header(text: str) -> Any:
    """The header text parsed as serde_json parses it.

    Raises:
        ValueError: what serde_json refuses (``json.JSONDecodeError`` is one).

    Example:
        >>> loads_header('{"a": [-0, 1]}')
        {'a': [-0.0, 1]}
    """
    return json.loads(
        text,
        parse_constant=_refuse_constant,
        parse_int=_serde_int,
        parse_float=_serde_float,
        object_pairs_hook=_no_duplicates,
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _serde_int(text: str) -> int | float:
    value = int(text)
    if text == "-0" or not -(2**63) <= value < 2**64:
        return _serde_float(text)  # no i64 or u64: serde reads a float
    return value


def _serde_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number out of range ({text[:24]}{'...' if len(text) > 24 else ''})")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {twice!r} appears twice")
    return result
