"""Folding repeated layers: ``layers.{0..31}.mlp.fc1.weight ×32``.

Every list of names shown to people (``ckpt inspect --group``, ``ckpt diff``'s missing keys,
``load_into``'s mismatch message) is folded here, by :func:`group_names` and :func:`fold_names`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["Group", "fold_indices", "fold_keys", "fold_names", "group_names"]

# Integers in canonical form only: "01" and "002" are other keys than "1" and "2", which a
# range like {1..2} could not name.
# A segment of more digits is no layer index: it stays text (int() refuses 4300 digits).
_INDEX = re.compile(r"(?<=\.)(?:0|[1-9]\d{0,17})(?=\.|$)|^(?:0|[1-9]\d{0,17})(?=\.|$)")
T = TypeVar("T")


@dataclass(frozen=True)
class Group:
    """Names that differ only in their numeric segments.

    Attributes:
        pattern: the folded name (``layers.{0..31}.fc.weight``).
        names: the member names, in first-seen order.
    """

    pattern: str
    names: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def label(self) -> str:
        """The pattern, with the member count when there is more than one (``h.{0..1}.w ×2``)."""
        return self.pattern + (f" ×{self.count}" if self.count > 1 else "")


def fold_indices(values: Sequence[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``{0..3}``; ``[0, 2, 5]`` -> ``{0,2,5}``; ``[4]`` -> ``4``."""
    ordered = sorted(set(values))
    if len(ordered) == 1:
        return str(ordered[0])
    # Distinct sorted values are a run exactly when they span their count; building the
    # range to compare with would take memory for {0, 10**12}.
    if ordered[-1] - ordered[0] + 1 == len(ordered):
        return f"{{{ordered[0]}..{ordered[-1]}}}"
    return "{" + ",".join(map(str, ordered)) + "}"


def group_names(
    items: Iterable[T],
    name: Callable[[T], str],
    signature: Callable[[T], Hashable] = lambda item: None,
) -> list[tuple[Group, list[T]]]:
    """Group items whose names differ only in numeric segments and whose signatures match.

    Args:
        items: things with names (tensor descriptors, diff rows).
        name: gets an item's name.
        signature: items group only when this agrees too (dtype and shape, say).

    Returns:
        ``(group, members)`` pairs in first-seen order; an item alone is its own group.

    Example:
        >>> [g.pattern for g, _ in group_names(["h.0.w", "h.1.w", "out"], str)]
        ['h.{0..1}.w', 'out']
    """
    buckets: dict[tuple[tuple[str, ...], Hashable], list[tuple[T, list[int]]]] = {}
    for item in items:
        texts, indices = _split(name(item))
        buckets.setdefault((texts, signature(item)), []).append((item, indices))
    out: list[tuple[Group, list[T]]] = []
    for (texts, _), members in buckets.items():
        if len(members) == 1:
            only = members[0][0]
            out.append((Group(name(only), (name(only),)), [only]))
            continue
        positions = list(zip(*(indices for _, indices in members)))
        pattern = texts[0]
        for position, tail in zip(positions, texts[1:]):
            pattern += fold_indices(position) + tail
        items_only = [item for item, _ in members]
        out.append((Group(pattern, tuple(name(i) for i in items_only)), items_only))
    return out


def _split(key_name: str) -> tuple[tuple[str, ...], list[int]]:
    """A name's text between its numeric segments, and those numbers: names that differ only
    in the numbers share the text (kept as parts, so no character of a name is a marker).

    Example:
        >>> _split("a.#.0.w")
        (('a.#.', '.w'), [0])
    """
    texts, indices, at = [], [], 0
    for found in _INDEX.finditer(key_name):
        texts.append(key_name[at : found.start()])
        indices.append(int(found.group()))
        at = found.end()
    texts.append(key_name[at:])
    return tuple(texts), indices


def fold_names(
    names: Iterable[str], limit: int | None = None, *, group: bool = True
) -> tuple[list[str], int]:
    """Names as people read them: repeated layers folded, at most ``limit`` lines.

    Args:
        names: keys, in order.
        limit: how many labels to keep; None keeps all.
        group: fold names that differ only in numeric segments (False lists each name).

    Returns:
        ``(labels, hidden)``: the labels kept, and how many more were left out.

    Example:
        >>> fold_names(["h.0.w", "h.1.w", "out", "extra"], limit=2)
        (['h.{0..1}.w ×2', 'out'], 1)
    """
    labels = [g.label for g, _ in group_names(names, str)] if group else list(names)
    if limit is None or len(labels) <= limit:
        return labels, 0
    return labels[:limit], len(labels) - limit


def fold_keys(keys: Iterable[str], limit: int = 6) -> str:
    """Keys folded on one line, at most ``limit`` groups.

    Example:
        >>> fold_keys([f"layers.{i}.attn.weight" for i in range(12)] + ["head.bias"])
        'layers.{0..11}.attn.weight ×12, head.bias'
    """
    labels, hidden = fold_names(keys, limit)
    return ", ".join(labels) + (f", ... ({hidden} more groups)" if hidden else "")
