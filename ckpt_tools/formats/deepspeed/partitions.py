"""Where each parameter's elements lie in the ranks' flat partitions, as DeepSpeed cuts them.

Pure arithmetic on sizes, checked as DeepSpeed's ``zero_to_fp32`` checks them:

* **ZeRO 1 and 2** (and the bf16 optimizer): each parameter group is one flat vector, the
  ranks' partitions back to back; its parameters lie in it one after the other, in the
  order of the group's ``param_shapes``, each followed by its alignment padding (when the
  run recorded ``param_alignment_paddings``). The group is padded to a multiple of twice
  the world size, so what the parameters use and what the partitions hold must agree up to
  that padding.
* **ZeRO 3**: every parameter is cut into ``ceil(numel / world)`` elements per rank (the
  last rank's piece padded); each rank's pieces lie one after the other in the virtual
  concatenation of its flat sub-groups, so a piece may straddle two sub-groups. Every rank
  holds the same sizes, and the pieces must use them exactly.

A parameter's elements are a list of :class:`Slice` s, in order; their lengths add up to
its element count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PartitionError", "Slice", "stage3_slices", "stage12_slices"]


class PartitionError(ValueError):
    """The shapes and the partitions do not fit together (the reader names the files)."""


@dataclass(frozen=True)
class Slice:
    """``numel`` elements from element ``start`` of rank ``rank``'s flat group ``group``."""

    rank: int
    group: int
    start: int
    numel: int


def _cut(
    bounds: Sequence[int], start: int, numel: int, rank_of: Sequence[tuple[int, int]]
) -> list[Slice]:
    """Elements ``start .. start+numel`` of a vector made of pieces that begin at
    ``bounds[i]`` (and end at ``bounds[i+1]``); ``rank_of[i]`` is piece i's (rank, group)."""
    out: list[Slice] = []
    at, end = start, start + numel
    i = 0
    while at < end:
        while bounds[i + 1] <= at:
            i += 1
        take = min(end, bounds[i + 1]) - at
        rank, group = rank_of[i]
        out.append(Slice(rank, group, at - bounds[i], take))
        at += take
    return out


def _bounds(sizes: Sequence[int]) -> list[int]:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return bounds


def stage12_slices(
    groups: Sequence[Mapping[str, int]],
    sizes: Sequence[Sequence[int]],
    paddings: Sequence[Sequence[int]] | None,
) -> dict[str, list[Slice]]:
    """Each parameter's slices in a ZeRO-1/2 checkpoint.

    Args:
        groups: per parameter group, name -> element count, in flat order.
        sizes: ``sizes[rank][group]``: the elements of each rank's partition.
        paddings: per group, each parameter's alignment padding, or None.

    Returns:
        name -> its slices.

    Raises:
        PartitionError: the shapes do not fit the partitions.

    Example:
        >>> stage12_slices([{"a": 3, "b": 2}], [[3], [3]], None)["b"]
        [Slice(rank=1, group=0, start=0, numel=2)]
    """
    world = len(sizes)
    if any(len(rank) != len(groups) for rank in sizes):
        raise PartitionError(
            f"the shapes list {len(groups)} parameter groups, the ranks' partitions "
            f"{[len(r) for r in sizes]}"
        )
    out: dict[str, list[Slice]] = {}
    for g, params in enumerate(groups):
        bounds = _bounds([sizes[r][g] for r in range(world)])
        pads = paddings[g] if paddings is not None else [0] * len(params)
        if len(pads) != len(params):
            raise PartitionError(
                f"group {g} has {len(params)} parameters and {len(pads)} alignment paddings"
            )
        offset = 0
        for (name, numel), pad in zip(params.items(), pads):
            if offset + numel > bounds[-1]:
                raise PartitionError(
                    f"group {g}'s parameters need more than the {bounds[-1]} elements its "
                    f"{world} partitions hold ({name!r} ends at {offset + numel})"
                )
            out[name] = _cut(bounds, offset, numel, [(r, g) for r in range(world)])
            offset += numel + pad
        align = 2 * world
        if math.ceil(offset / align) != math.ceil(bounds[-1] / align):
            raise PartitionError(
                f"group {g}'s parameters use {offset} elements, its {world} partitions hold "
                f"{bounds[-1]}"
            )
    return out


def stage3_slices(
    params: Mapping[str, int], sizes: Sequence[Sequence[int]]
) -> dict[str, list[Slice]]:
    """Each parameter's slices in a ZeRO-3 checkpoint.

    Args:
        params: name -> element count, every group's in order.
        sizes: ``sizes[rank][sub_group]``: the elements of each rank's flat sub-groups.

    Returns:
        name -> its slices (rank 0's piece first, the padding of the last left out).

    Raises:
        PartitionError: the ranks' sizes differ, or the shapes do not use them exactly.

    Example:
        >>> stage3_slices({"a": 3}, [[2], [2]])["a"]
        [Slice(rank=0, group=0, start=0, numel=2), Slice(rank=1, group=0, start=0, numel=1)]
    """
    world = len(sizes)
    if any(list(rank) != list(sizes[0]) for rank in sizes):
        raise PartitionError(f"the ranks' flat groups differ in size: {[list(r) for r in sizes]}")
    bounds = _bounds(sizes[0])
    out: dict[str, list[Slice]] = {}
    offset = 0
    for name, numel in params.items():
        piece = math.ceil(numel / world)
        if offset + piece > bounds[-1]:
            raise PartitionError(
                f"the parameters need more than the {bounds[-1]} elements each rank holds "
                f"({name!r} ends at {offset + piece})"
            )
        slices: list[Slice] = []
        left = numel
        for rank in range(world):
            take = min(piece, left)
            owners = [(rank, k) for k in range(len(bounds) - 1)]
            slices += _cut(bounds, offset, take, owners)
            left -= take
        out[name] = slices
        offset += piece
    if offset != bounds[-1]:
        raise PartitionError(
            f"the parameters use {offset} elements of each rank's partition, which holds "
            f"{bounds[-1]}"
        )
    return out
