"""How a Hugging Face sharded folder is laid out: shard sizes, the plan, and the index.

The layout is ``huggingface_hub.save_torch_state_dict``'s: ``model-00001-of-0000N.safetensors``
files plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
{name: file}}``), or a lone ``model.safetensors`` (no index) when everything fits in one shard.
Tensors are split greedily in their order; a tensor larger than the limit gets a shard of its
own, as huggingface_hub's ``split_state_dict_into_shards_factory`` does. Nothing here reads or
writes a file (:mod:`ckpt_tools.io.writers.hf_folder` writes the folder).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from ckpt_tools.errors import UsageError

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "SHARD_PATTERN",
    "SIZE_UNITS",
    "ShardPlan",
    "index_bytes",
    "parse_shard_size",
    "plan_shards",
]

#: huggingface_hub's default ``max_shard_size``.
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: Shard file names: ``suffix`` is ``-00001-of-00004``, or empty for a single file.
SHARD_PATTERN = "model{suffix}.safetensors"
#: The index beside the shards.
INDEX_NAME = "model.safetensors.index.json"
#: Units ``--max-shard-size`` accepts: decimal as huggingface_hub reads them ("5GB" is
#: 5*10**9), binary as transformers also accepts them ("5GiB" is 5*2**30).
SIZE_UNITS: Mapping[str, int] = {
    "TIB": 2**40,
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "B": 1,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_shard_size(value: str | int) -> int:
    """Bytes from a shard size: an int, ``"5GB"`` (10**9), ``"500MiB"`` (2**20), ``"1000"``.

    Args:
        value: the size; units are those of :data:`SIZE_UNITS`, case-insensitive.

    Returns:
        The size in bytes, at least 1.

    Raises:
        UsageError: not a positive size with a known unit.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("5GiB"), parse_shard_size("1.5kb")
        (5000000000, 5368709120, 1500)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else ""
        if match is None or (unit and unit not in SIZE_UNITS):
            raise UsageError(
                "expected a size like 5GB, 500MB or 2GiB "
                f"(units: {', '.join(u for u in SIZE_UNITS if u != 'B')})",
                argument="max_shard_size",
                value=repr(value),
                flag="--max-shard-size",
            )
        # Exact, as a fraction: a float rounds a long byte count and overflows on a huge one.
        count = Fraction(match.group(1))
        if unit in ("", "B") and count.denominator != 1:
            raise UsageError(
                "a byte count is a whole number (or give a unit: 1.5KB)",
                argument="max_shard_size",
                value=repr(value),
                flag="--max-shard-size",
            )
        size = int(count * SIZE_UNITS[unit or "B"])
    if size < 1:
        raise UsageError(
            "must be at least 1 byte",
            argument="max_shard_size",
            value=repr(value),
            flag="--max-shard-size",
        )
    return size


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go into which file.

    Attributes:
        files: ``(file name, tensor names)`` in file order.
        total_size: bytes of tensor data over all files (the index's ``total_size``).
        max_shard_size: the limit the plan was made for, in bytes.
    """

    files: tuple[tuple[str, tuple[str, ...]], ...]
    total_size: int
    max_shard_size: int

    @property
    def is_sharded(self) -> bool:
        """More than one file: an index is written."""
        return len(self.files) > 1

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name, in file order."""
        return {name: file for file, names in self.files for name in names}


def plan_shards(
    sizes: Sequence[tuple[str, int]], max_shard_size: int, pattern: str = SHARD_PATTERN
) -> ShardPlan:
    """Split tensors into shards greedily, in order, as huggingface_hub does.

    A tensor that would take the current shard over ``max_shard_size`` starts a new one; a
    tensor larger than the limit gets a shard of its own, placed where huggingface_hub places
    it (before the shard still being filled).

    Args:
        sizes: ``(name, nbytes)`` of every tensor, in output order.
        max_shard_size: the limit in bytes (see :func:`parse_shard_size`).
        pattern: file names, formatted with ``suffix``.

    Returns:
        The plan; one file named ``pattern.format(suffix="")`` when all fits in one.

    Example:
        >>> plan = plan_shards([("a", 6), ("b", 6), ("c", 2), ("d", 20)], 10)
        >>> [names for _, names in plan.files]
        [('a',), ('d',), ('b', 'c')]
        >>> plan.files[0][0], plan.total_size
        ('model-00001-of-00003.safetensors', 34)
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for name, nbytes in sizes:
        total += nbytes
        if nbytes > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + nbytes > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return ShardPlan(((pattern.format(suffix=""), tuple(shards[0])),), total, max_shard_size)
    n = len(shards)
    files = tuple(
        (pattern.format(suffix=f"-{i + 1:05d}-of-{n:05d}"), tuple(names))
        for i, names in enumerate(shards)
    )
    return ShardPlan(files, total, max_shard_size)


def index_bytes(plan: ShardPlan, metadata: Mapping[str, str] | None = None) -> bytes:
    """The ``model.safetensors.index.json`` of ``plan`` (``json.dumps(indent=2)``, as the hub's).

    Args:
        plan: from :func:`plan_shards`.
        metadata: extra string entries for the index's ``metadata``, after ``total_size``
            (tied names recorded by :func:`~ckpt_tools.formats.safetensors.tie_metadata`).

    Returns:
        The file's bytes.

    Example:
        >>> plan = plan_shards([("a", 6), ("b", 6)], 10)
        >>> json.loads(index_bytes(plan))["weight_map"]["b"]
        'model-00002-of-00002.safetensors'
    """
    # The plan's own total_size: an input's stale one never stands in for it.
    extra = {k: v for k, v in (metadata or {}).items() if k != "total_size"}
    index = {
        "metadata": {"total_size": plan.total_size, **extra},
        "weight_map": plan.weight_map,
    }
    return (json.dumps(index, indent=2) + "\n").encode()
