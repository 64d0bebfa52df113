"""Walking and comparing object trees as torch loads them: one walker, one bitwise comparer."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

# What ``inspect`` reports per tensor, field by field.
GEOMETRY = ("dtype", "shape", "stride", "offset", "nbytes", "device")


def walk_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a torch-loaded tree, with dotted paths, in the tree's order.

    The paths are those :func:`ckpt_tools.structure.tensor_walk.iter_tensors` gives: dict keys and
    list indices joined by dots; a container reached twice is walked once, a tensor reached
    twice (tied weights) is listed twice.
    """
    seen: set[int] = set()

    def walk(node: Any, where: str) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(node, torch.Tensor):
            yield where, node
            return
        if id(node) in seen:
            return
        if isinstance(node, Mapping):
            seen.add(id(node))
            for k, v in node.items():
                yield from walk(v, f"{where}.{k}" if where else str(k))
        elif isinstance(node, (list, tuple)):
            seen.add(id(node))
            for i, v in enumerate(node):
                yield from walk(v, f"{where}.{i}" if where else str(i))

    return walk(obj, path)


def child(node: Any, key: str) -> Any:
    """``node[key]`` where the path spells int keys as digits (``optimizer.state.0``)."""
    if isinstance(node, Mapping):
        return node[key] if key in node else node[int(key)]
    return node[int(key)]


def at_path(root: Any, path: str | Sequence[str]) -> Any:
    """The node at ``path``: a dotted string (``"model.ema"``; ``""`` is the root) or keys."""
    parts = [p for p in path.split(".") if p] if isinstance(path, str) else path
    for key in parts:
        root = child(root, key)
    return root


def tensors_of(mapping: Mapping[Any, Any]) -> dict[str, torch.Tensor]:
    """The tensor values of a mapping, by string key, in order."""
    return {str(k): v for k, v in mapping.items() if isinstance(v, torch.Tensor)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    return getattr(torch, name)


def describe(t: Any) -> dict[str, Any]:
    """A tensor's geometry as ``inspect`` reports it (the :data:`GEOMETRY` fields).

    Asked of torch for a ``torch.Tensor``; read off the fields of our own ``TensorInfo`` or
    ``TensorRef`` otherwise, so the two compare with ``==``.
    """
    if isinstance(t, torch.Tensor):
        return {
            "dtype": dtype_name(t.dtype),
            "shape": tuple(t.shape),
            "stride": t.stride(),
            "offset": t.storage_offset(),
            "nbytes": t.numel() * t.element_size(),
            "device": str(t.device),
        }
    return {field: getattr(t, field) for field in GEOMETRY}


def partition(pairs: Sequence[tuple[str, Any]]) -> set[frozenset[str]]:
    """Group names by a sharing key (torch: storage data_ptr; ours: StorageRef identity)."""
    groups: dict[Any, set[str]] = {}
    for name, key in pairs:
        groups.setdefault(key, set()).add(name)
    return {frozenset(g) for g in groups.values()}


def storage_groups(obj: Any) -> set[frozenset[str]]:
    """Which tensors of a torch-loaded tree share a storage (empty storages left out)."""
    return partition(
        [
            (name, t.untyped_storage().data_ptr())
            for name, t in walk_tensors(obj)
            if t.untyped_storage().nbytes()
        ]
    )


def value_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in row-major order, as raw bytes (NaN payloads and -0.0 kept)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole untyped storage under ``t``, as uint8."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def assert_values_bitwise(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    """Same dtype, shape and element bytes (layout may differ: contiguous copies, dedup)."""
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    assert torch.equal(value_bytes(a), value_bytes(b)), f"{where}: value bytes differ"


def assert_tensor_bitwise(a: torch.Tensor, b: torch.Tensor, where: str = "") -> None:
    """Same class, dtype, shape, strides, storage offset, requires_grad, device, bytes."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    assert_values_bitwise(a, b, where)
    assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
    assert a.storage_offset() == b.storage_offset(), f"{where}: storage offset differs"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    assert a.device == b.device, f"{where}: device {a.device} != {b.device}"
    assert torch.equal(storage_bytes(a), storage_bytes(b)), f"{where}: storage bytes differ"


def assert_bitwise_equal(a: Any, b: Any, where: str = "root") -> None:
    """Two torch-loaded trees are the same, bit for bit.

    Compares container types and key order, ``_metadata`` of state dicts, floats by their
    bits, tensors with :func:`assert_tensor_bitwise`, and which tensors share a storage.
    """
    _assert_same(a, b, where)
    assert storage_groups(a) == storage_groups(b), "storage sharing differs"


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b)}"
        assert_tensor_bitwise(a, b, where)
        return
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, Mapping):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
        meta_a, meta_b = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
        assert meta_a == meta_b, f"{where}: _metadata {meta_a} != {meta_b}"
        if meta_a is not None:
            assert list(meta_a) == list(meta_b), f"{where}: _metadata order differs"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, float):
        assert _float_bits(a) == _float_bits(b) or (math.isnan(a) and math.isnan(b)), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
