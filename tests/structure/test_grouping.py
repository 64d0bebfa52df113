"""``structure.grouping``: a folded pattern names exactly the keys it stands for.

The oracle is the keys themselves: expanding a ``{a..b}`` or ``{a,b}`` pattern gives back
every member name, so a key such as ``l.01.w`` (another key than ``l.1.w`` to torch) is never
folded into a range that cannot name it.
"""

from __future__ import annotations

import itertools
import re

from ckpt_tools.structure.grouping import fold_names, group_names


def _expand(pattern: str) -> set[str]:
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            choices.append([part])
        elif ".." in part:
            lo, hi = part.split("..")
            choices.append([str(n) for n in range(int(lo), int(hi) + 1)])
        else:
            choices.append(part.split(","))
    return {"".join(c) for c in itertools.product(*choices)}


def test_leading_zeros_are_other_keys() -> None:
    keys = ["l.1.w", "l.01.w", "l.2.w", "l.002.w", "0.x", "00.x", "1.x"]
    groups = group_names(keys, str)
    for group, _ in groups:
        assert _expand(group.pattern) == set(group.names), group
    assert sorted(n for g, _ in groups for n in g.names) == sorted(keys)
    assert [g.label for g, _ in groups] == [
        "l.{1..2}.w ×2",
        "l.01.w",
        "l.002.w",
        "{0..1}.x ×2",
        "00.x",
    ]


def test_a_hash_in_a_name_is_text_not_a_fold() -> None:
    # '#' is a character a key may hold: a.#.w is not a.0.w, and x#y.1.z keeps its '#'.
    labels, _ = fold_names(["a.#.w", "a.0.w", "x#y.1.z", "x#y.2.z"])
    assert labels == ["a.#.w", "a.0.w", "x#y.{1..2}.z ×2"]


def test_a_numeric_segment_too_long_for_an_index_is_text() -> None:
    # int() refuses 4300 digits; no layer has an index of 19 digits.
    long_index = "9" * 5000
    labels, _ = fold_names([f"h.{long_index}.w", "h.0.w", "h.1.w"])
    assert labels == [f"h.{long_index}.w", "h.{0..1}.w ×2"]
