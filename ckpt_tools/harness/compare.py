"""Tensor and state-dict comparison helpers for the parity checks.

"Bitwise" here means same dtype, same shape and same bytes: stricter than
``torch.equal`` (which calls ``-0.0 == 0.0`` and ``nan != nan``), which is what a lossless
checkpoint rewrite has to preserve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["bitwise_equal", "compare_state_dicts", "load_pt", "max_abs_diff", "storage_tags"]


def load_pt(path: str | Path) -> dict[str, Any]:
    """``torch.load`` onto the CPU with ``weights_only=True``: the trusted reference reader."""
    return torch.load(path, map_location="cpu", weights_only=True)


def storage_tags(path: str | Path) -> set[str]:
    """The device tags (``"cpu"``, ``"cuda:1"``) recorded for the storages in a ``.pt`` file.

    A ``map_location`` callable sees each storage's saved location before placing it;
    returning the (CPU) storage unchanged reads any tag on any machine.
    """
    seen: set[str] = set()

    def record(storage: Any, location: str) -> Any:
        seen.add(location)
        return storage

    torch.load(path, map_location=record, weights_only=True)
    return seen


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """Largest ``|a - b|``, computed in float64 on the CPU; ``inf`` if shapes differ."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Same dtype, shape and bytes (so ``-0.0`` differs from ``0.0`` and NaNs compare)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a_bytes, b_bytes)


def compare_state_dicts(
    ref: Mapping[str, Any], got: Mapping[str, Any], *, bitwise: bool = True
) -> tuple[float, list[str]]:
    """Compare two flat state dicts tensor by tensor.

    Args:
        ref: the expected state dict.
        got: the one to check.
        bitwise: require identical bytes; otherwise only report ``max_abs_diff`` (integer
            tensors must still be equal).

    Returns:
        ``(max_abs_diff over all tensors, problems)``; ``problems`` lists key or dtype
        mismatches and, when ``bitwise``, tensors whose bytes differ.
    """
    problems: list[str] = []
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    if missing:
        problems.append(f"missing keys {missing[:3]}")
    if extra:
        problems.append(f"unexpected keys {extra[:3]}")
    worst = math.inf if missing or extra else 0.0
    for key in ref.keys() & got.keys():
        a, b = ref[key], got[key]
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            if a != b:
                problems.append(f"{key}: {a!r} != {b!r}")
            continue
        worst = max(worst, max_abs_diff(a, b))
        if a.dtype != b.dtype:
            problems.append(f"{key}: dtype {a.dtype} != {b.dtype}")
        elif bitwise and not bitwise_equal(a, b):
            problems.append(f"{key}: bytes differ")
        elif not a.is_floating_point() and not torch.equal(a.cpu(), b.cpu()):
            problems.append(f"{key}: integer values differ")
    return worst, problems
