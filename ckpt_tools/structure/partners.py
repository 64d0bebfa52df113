"""Which key on the other side is the same tensor with other wrappers around it. Torch-free.

Each key is peeled of its own wrappers (the prefixes of
:data:`~ckpt_tools.structure.wrappers.WRAPPER_RULES` it starts with, and the inner segments
anywhere in it); two keys with one bare name, each the only one on its side, are partners.
:mod:`ckpt_tools.structure.suggest` checks every rewrite against these pairs, so that no
rewrite sends a key onto another key's tensor.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ckpt_tools.structure.wrappers import WRAPPER_RULES

__all__ = ["wrapper_partners"]

#: Wrapper prefixes that only lead a key (``module.``, ``model.``).
_LEADING = tuple(r.prefix for r in WRAPPER_RULES if not r.inner)

#: Wrapper segments that may sit anywhere in a key (``blocks.1._orig_mod.weight``).
_INNER_SEGMENTS = re.compile(
    r"(^|(?<=\.))(?:" + "|".join(re.escape(r.prefix) for r in WRAPPER_RULES if r.inner) + ")"
)


def _bare(keys: Sequence[str]) -> dict[str, str]:
    """Each key without its wrappers: every wrapper segment inside it, and the wrapper
    prefixes it starts with (``module.blocks.1._orig_mod.weight`` -> ``blocks.1.weight``).

    Each key is peeled on its own, not by the stack all keys share: one key without the
    wrapper (a ``step`` tensor beside DDP's keys) must not leave the others unpaired.
    """
    out = {}
    for key in keys:
        bare = _INNER_SEGMENTS.sub("", key)
        while prefix := next((p for p in _LEADING if bare.startswith(p)), None):
            bare = bare[len(prefix) :]
        out[key] = bare
    return out


def wrapper_partners(source: Sequence[str], target: Sequence[str]) -> dict[str, str]:
    """Each unmatched ``source`` key -> the unmatched ``target`` key that is the same tensor
    with other wrappers around it, where exactly one key on each side has that name bare.

    Args:
        source: keys to rewrite.
        target: keys to match.

    Returns:
        The pairs; keys with no such partner (or several) are left out.

    Example:
        >>> wrapper_partners(["a.w", "b._orig_mod.w"], ["a.w", "b.w"])
        {'b._orig_mod.w': 'b.w'}
    """
    target_set, source_set = set(target), set(source)
    by_bare: dict[str, tuple[list[str], list[str]]] = {}
    for key, bare in _bare(source).items():
        if key not in target_set:
            by_bare.setdefault(bare, ([], []))[0].append(key)
    for key, bare in _bare(target).items():
        if key not in source_set and bare in by_bare:
            by_bare[bare][1].append(key)
    return {ks[0]: kt[0] for ks, kt in by_bare.values() if len(ks) == 1 and len(kt) == 1}
