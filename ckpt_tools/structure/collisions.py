"""A key rewrite that would merge two keys into one, refused with the reason: keys that were
one already (``module.w`` beside ``w``), or rules whose order renames a key twice (a swap)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckpt_tools.errors import KeyCollisionError, Remedy

if TYPE_CHECKING:
    from ckpt_tools.structure.keys import KeyRule

__all__ = ["collision_error"]

_SWAP = (
    "rules apply in order, each to the keys the ones before it made, so a key renamed to "
    "another key's name is renamed again with it: to swap two names, rename one through a "
    "third (a -> tmp, b -> a, tmp -> b)"
)


def collision_error(
    collisions: Sequence[tuple[str, tuple[str, ...]]],
    keys: Sequence[str],
    rules: Sequence[KeyRule],
) -> KeyCollisionError:
    """The refusal of ``collisions`` (new key, the old keys it would merge), with its fix.

    Example:
        >>> from ckpt_tools.structure.keys import sub_rule
        >>> swap = [sub_rule("enc.", "dec."), sub_rule("dec.", "enc.")]
        >>> err = collision_error((("enc.w", ("enc.w", "dec.w")),), ["enc.w", "dec.w"], swap)
        >>> "to swap two names" in str(err)
        True
    """
    shown = "; ".join(f"{' and '.join(map(repr, olds))} -> {new!r}" for new, olds in collisions[:3])
    remedies = (
        Remedy(text="remove the duplicates first"),
        Remedy(command="ckpt rename IN OUT --sub OLD=NEW", text="to rename one side"),
    )
    if _renamed_twice(collisions, set(keys), rules):  # a swap, written as two rules
        remedies = (Remedy(text=_SWAP),)
    return KeyCollisionError(
        f"the rewrite would merge {len(collisions)} pair(s) of keys into one: {shown}"
        f"{' ...' if len(collisions) > 3 else ''}",
        tuple(collisions),
        remedies=remedies,
    )


def _renamed_twice(
    collisions: Sequence[tuple[str, tuple[str, ...]]], keys: set[str], rules: Sequence[KeyRule]
) -> bool:
    """Whether a colliding key passed, on its way, through the name of another key of the
    state dict (``enc.`` -> ``dec.`` -> ``enc.``): the collision is the rules' order, not two
    keys that were one already."""
    for _, olds in collisions:
        for old in olds:
            name = old
            for rule in rules[:-1]:
                name = rule.apply(name)
                if name != old and name in keys:
                    return True
    return False
