"""Hugging Face sharded safetensors folders: shard names, the greedy split, the index.

As ``huggingface_hub`` writes them: ``model-00001-of-00004.safetensors`` ...,
``model.safetensors.index.json`` with ``metadata.total_size`` and ``weight_map``; sizes use
decimal units (``5GB`` = 5 * 10**9 bytes); tensors are split greedily in key order, and a
tensor over the limit gets a shard of its own. A single shard is ``model.safetensors``
without an index.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from ckpt_tools.errors import UsageError

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "index_json",
    "parse_size",
    "shard_names",
    "split_shards",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"
INDEX_NAME = "model.safetensors.index.json"
# huggingface_hub's SIZE_UNITS (decimal), plus the binary units people also write.
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB``, ``500MB``, ``2GiB`` or an int (huggingface_hub's decimal units).

    Raises:
        UsageError: not a positive size.

    Example:
        >>> parse_size("5GB"), parse_size("1KiB"), parse_size(100)
        (5000000000, 1024, 100)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise UsageError(
                f"max_shard_size={size!r} is not a size; write e.g. '5GB' or '500MB'",
                argument="max_shard_size",
                value=size,
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(
            f"max_shard_size={size!r} must be positive", argument="max_shard_size", value=size
        )
    return value


def split_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """Greedy split in key order: a shard takes tensors until the next would pass the limit.

    Example:
        >>> split_shards({"a": 6, "b": 5, "c": 20, "d": 1}, 10)
        [['a'], ['b'], ['c'], ['d']]
        >>> split_shards({"a": 3, "b": 3, "c": 3}, 10)
        [['a', 'b', 'c']]
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if current and used + size > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` shards.

    Example:
        >>> shard_names(2)
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
        >>> shard_names(1)
        ['model.safetensors']
    """
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_json(files: Sequence[str], shards: Sequence[Sequence[str]], total_size: int) -> bytes:
    """The ``model.safetensors.index.json`` bytes (``json.dump(indent=2)``, as the hub's).

    Example:
        >>> print(index_json(["a.safetensors"], [["w"]], 8).decode().strip())
        {
          "metadata": {
            "total_size": 8
          },
          "weight_map": {
            "w": "a.safetensors"
          }
        }
    """
    weight_map = {name: file for file, names in zip(files, shards) for name in names}
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return json.dumps(index, indent=2).encode() + b"\n"
