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
    """Read a ``.pt`` file the plain way, as the reference the checks compare against.

    ``torch.load`` onto the CPU with ``weights_only=True``: nothing of ckpt_tools is
    involved, so a bug in the code under test cannot hide in its own reference.

    Args:
        path: a ``torch.save`` file.

    Returns:
        Whatever was saved, tensors on the CPU.

    Raises:
        pickle.UnpicklingError: the file holds objects ``weights_only`` refuses.
        RuntimeError: the file is not a torch checkpoint.

    Example:
        >>> load_pt("out/ddp/bare.pt")["net.1.weight"].device
        device(type='cpu')
    """
    return torch.load(path, map_location="cpu", weights_only=True)


def storage_tags(path: str | Path) -> set[str]:
    """The device tags (``"cpu"``, ``"cuda:1"``) recorded for the storages in a ``.pt`` file.

    A ``map_location`` callable sees each storage's saved location before placing it;
    returning the (CPU) storage unchanged reads any tag on any machine, GPU or not.

    Args:
        path: a ``torch.save`` file.

    Returns:
        The set of saved location tags.

    Raises:
        RuntimeError: the file is not a torch checkpoint.

    Example:
        >>> from ckpt_tools import retag
        >>> _ = retag("out/ddp/wrapped.pt", "wrapped.cuda1.pt", {"cpu": "cuda:1"})
        >>> storage_tags("out/ddp/wrapped.pt"), storage_tags("wrapped.cuda1.pt")
        ({'cpu'}, {'cuda:1'})
    """
    seen: set[str] = set()

    def record(storage: Any, location: str) -> Any:
        seen.add(location)
        return storage

    torch.load(path, map_location=record, weights_only=True)
    return seen


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    """Largest ``|a - b|``, computed in float64 on the CPU.

    Args:
        a: a tensor on any device.
        b: another.

    Returns:
        The maximum absolute elementwise difference; 0.0 for empty tensors, ``inf`` when
        the shapes differ.

    Example:
        >>> max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))
        0.5
    """
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    return float((a.detach().cpu().double() - b.detach().cpu().double()).abs().max())


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    """Tell whether two tensors have the same dtype, shape and bytes.

    Stricter than ``torch.equal``: ``-0.0`` differs from ``0.0``, and a NaN equals the same
    NaN, which is what a lossless rewrite must preserve.

    Args:
        a: a tensor on any device.
        b: another.

    Returns:
        True when the two are indistinguishable byte for byte.

    Example:
        >>> bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
        False
    """
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

    Example:
        >>> compare_state_dicts({"w": torch.ones(2)}, {"w": torch.ones(2)})
        (0.0, [])
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
