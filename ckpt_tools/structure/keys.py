"""Key rewrites, as data, applied by one generic function.

A :class:`KeyRule` is one regex substitution; :func:`plan_renames` applies a list of rules
to a list of keys (and refuses collisions, saying whether they are duplicates or a swap the
rules' order makes); everything else here builds rules or applies a plan to an in-memory
state dict. What training wrappers add to keys, the rules that strip them and
``strip_prefix`` / ``add_prefix`` are :mod:`ckpt_tools.structure.wrappers`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ckpt_tools._types import items_of
from ckpt_tools.errors import KeyCollisionError, Remedy, UsageError
from ckpt_tools.structure.attributes import carry_attributes

__all__ = [
    "KeyRule",
    "add_rule",
    "apply_plan",
    "apply_rules",
    "check_replacement",
    "compile_pattern",
    "idle_rules",
    "key_heads",
    "literal_replacement",
    "plan_renames",
    "regex_rule",
    "rename_keys",
    "rule_items",
    "strip_rule",
    "sub_rule",
]


@dataclass(frozen=True)
class KeyRule:
    """One key substitution: ``re.sub(pattern, replacement, key, count)``.

    Attributes:
        pattern: a regular expression.
        replacement: its replacement (``\\1`` back-references allowed).
        count: substitutions per key; 0 means all.
        description: how a person would say it (``strip 'module.'``).
    """

    pattern: str
    replacement: str
    count: int = 1
    description: str = ""

    def __post_init__(self) -> None:
        # A bad replacement would otherwise surface mid-rewrite, as re's own error.
        check_replacement(self.pattern, self.replacement)

    def apply(self, key: str) -> str:
        return re.sub(self.pattern, self.replacement, key, count=self.count)


def strip_rule(prefix: str, inner: bool = False) -> KeyRule:
    """A rule removing ``prefix`` at the start of keys (and, with ``inner``, after any dot)."""
    if inner:
        return KeyRule(rf"(^|(?<=\.)){re.escape(prefix)}", "", 0, f"strip {prefix!r} everywhere")
    return KeyRule(f"^{re.escape(prefix)}", "", 1, f"strip {prefix!r}")


def literal_replacement(text: str) -> str:
    """``text`` as an ``re.sub`` replacement that writes it as it is: a backslash in a key
    is no escape.

    Example:
        >>> re.sub("^", literal_replacement("pre\\\\x."), "w")
        'pre\\\\x.w'
    """
    return text.replace("\\", "\\\\")


def add_rule(prefix: str) -> KeyRule:
    """A rule putting ``prefix`` in front of every key."""
    return KeyRule("^", literal_replacement(prefix), 1, f"add {prefix!r}")


def sub_rule(old: str, new: str) -> KeyRule:
    """A prefix map: keys starting with ``old`` start with ``new`` instead.

    Args:
        old: the prefix to replace.
        new: what replaces it (``""`` strips it).

    Returns:
        The :class:`KeyRule`, for :func:`rename_keys` or ``ckpt_tools.rename(..., rules=)``.

    Raises:
        Nothing: any two strings make a rule.

    Example:
        >>> rename_keys({"backbone.w": 1, "head.w": 2}, [sub_rule("backbone.", "encoder.")])
        {'encoder.w': 1, 'head.w': 2}
    """
    return KeyRule(f"^{re.escape(old)}", literal_replacement(new), 1, f"{old!r} -> {new!r}")


def regex_rule(pattern: str, replacement: str) -> KeyRule:
    """A regex substitution on every key (all matches), as ``re.sub`` makes it.

    Args:
        pattern: a regular expression.
        replacement: its replacement (``\\1`` for groups).

    Returns:
        The :class:`KeyRule`, for :func:`rename_keys` or ``ckpt_tools.rename(..., rules=)``.

    Raises:
        UsageError: the pattern does not compile, or the replacement refers to a group the
            pattern lacks (``\\9``, ``\\g<name>``) or holds an escape ``re`` refuses.

    Example:
        >>> rename_keys({"blocks.0.w": 1}, [regex_rule(r"^blocks\\.", "layers.")])
        {'layers.0.w': 1}
    """
    return KeyRule(pattern, replacement, 0, f"s/{pattern}/{replacement}/")


def check_replacement(pattern: str, replacement: str) -> None:
    """Refuse a rule that ``re.sub`` could not apply: a bad pattern, or a replacement that does
    not fit it.

    Args:
        pattern: the rule's regular expression.
        replacement: its replacement template.

    Returns:
        None: the rule can be applied to any key.

    Raises:
        UsageError: the pattern does not compile, or the replacement refers to a group the
            pattern lacks or holds an escape ``re`` refuses; the message names the rule.

    Example:
        >>> check_replacement("(a)", r"\\2")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: replacement='\\\\2': the rule s/(a)/\\2/ cannot be ...
    """
    compiled = compile_pattern(pattern, argument="pattern", flag="--regex pattern")
    try:
        # re compiles the template against the pattern's groups before it searches: on an
        # empty string that is the whole check, whether or not the pattern matches.
        compiled.sub(replacement, "")
    except (re.error, IndexError) as e:
        n = compiled.groups
        groups = "no group" if not n else f"{n} group{'s' if n > 1 else ''}"
        names = "".join(f", <{name}>" for name in compiled.groupindex)
        message = (
            f"the rule s/{pattern}/{replacement}/ cannot be applied: {e}; the pattern has "
            f"{groups}{names}"
        )
        fix = r"refer only to groups it has (\g<0> is the whole match); write a backslash as \\"
        raise UsageError(
            message,
            argument="replacement",
            value=repr(replacement),
            flag="--regex replacement",
            remedies=(Remedy(text=fix),),
        ) from e


def compile_pattern(pattern: str, *, argument: str, flag: str) -> re.Pattern[str]:
    """``pattern`` compiled, or the :class:`UsageError` naming the argument that gave it.

    Example:
        >>> compile_pattern("(", argument="keep_dtype", flag="--keep-dtype")
        Traceback (most recent call last):
        ckpt_tools.errors.UsageError: keep_dtype='(': not a valid regular expression: ...
    """
    try:
        return re.compile(pattern)
    except re.error as e:
        message = f"not a valid regular expression: {e}"
        raise UsageError(message, argument=argument, value=repr(pattern), flag=flag) from e


def apply_rules(key: str, rules: Sequence[KeyRule]) -> str:
    """``key`` after each of ``rules`` in turn.

    Example:
        >>> apply_rules("module.fc.w", [strip_rule("module."), sub_rule("fc.", "head.")])
        'head.w'
    """
    for rule in rules:
        key = rule.apply(key)
    return key


def plan_renames(keys: Sequence[str], rules: Sequence[KeyRule]) -> dict[str, str]:
    """Apply ``rules`` in order to each key: the one generic key rewrite.

    Args:
        keys: the keys, in order.
        rules: substitutions applied one after another.

    Returns:
        old key -> new key, in the order of ``keys``.

    Raises:
        KeyCollisionError: two keys would become one (``module.w`` and ``w`` when stripping).

    Example:
        >>> plan_renames(["module.fc.weight"], [strip_rule("module.")])
        {'module.fc.weight': 'fc.weight'}
    """
    plan: dict[str, str] = {}
    sources: dict[str, list[str]] = {}
    for key in keys:
        plan[key] = new = apply_rules(key, rules)
        sources.setdefault(new, []).append(key)
    collisions = tuple((new, tuple(olds)) for new, olds in sources.items() if len(olds) > 1)
    if collisions:
        raise _collision_error(collisions, keys, rules)
    return plan


_SWAP = (
    "rules apply in order, each to the keys the ones before it made, so a key renamed to "
    "another key's name is renamed again with it: to swap two names, rename one through a "
    "third (a -> tmp, b -> a, tmp -> b)"
)


def _collision_error(
    collisions: Sequence[tuple[str, tuple[str, ...]]],
    keys: Sequence[str],
    rules: Sequence[KeyRule],
) -> KeyCollisionError:
    """The refusal of ``collisions`` (new key, the old keys it would merge), with its fix."""
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


def idle_rules(keys: Sequence[Any], rules: Sequence[KeyRule]) -> list[KeyRule]:
    """The rules that change no key where they apply, in order (after the rules before them):
    a typo, or a second rule for keys a first one renamed.

    Example:
        >>> rules = [sub_rule("layers.", "blocks."), sub_rule("haed.", "head.")]
        >>> [r.description for r in idle_rules(["layers.0.w", "head.w"], rules)]
        ["'haed.' -> 'head.'"]
    """
    used = [False] * len(rules)
    for key in keys:
        if not isinstance(key, str):  # (an int key: no rule renames it)
            continue
        for i, rule in enumerate(rules):
            new = rule.apply(key)
            used[i] = used[i] or new != key
            key = new
    return [rule for rule, was in zip(rules, used) if not was]


_SD = TypeVar("_SD", bound=Mapping[str, Any])


def apply_plan(sd: Mapping[str, Any], plan: Mapping[str, str], rules: Sequence[KeyRule]) -> dict:
    """A new dict: keys renamed by ``plan``, same values and order, attributes kept.

    An OrderedDict's attributes come back from ``torch.load`` as saved, so every one is
    kept; the module paths in a ``_metadata`` mapping are renamed by the same ``rules`` (as
    torch's ``consume_prefix_in_state_dict_if_present`` does for ``module.``).
    """
    out = type(sd)() if isinstance(sd, dict) else {}
    for key, value in sd.items():
        out[plan.get(key, key)] = value
    carry_attributes(sd, out, rules)
    return out


def rule_items(rules: object) -> tuple[KeyRule, ...]:
    """``rules`` checked: a :class:`KeyRule` or a sequence of them (one rule alone is one).

    Raises:
        UsageError: anything else (a ``"OLD=NEW"`` string, ``("OLD", "NEW")`` pairs, a dict).
    """
    expected = "a KeyRule or a sequence of KeyRule, such as [sub_rule('OLD', 'NEW')]"
    return items_of(rules, "rules", KeyRule, expected)


def rename_keys(sd: Mapping[str, Any], rules: Sequence[KeyRule]) -> dict:
    """Rename the keys of an in-memory state dict by ``rules``.

    Args:
        sd: a state dict (values are left as they are, tensors are not copied).
        rules: :class:`KeyRule` s, e.g. ``[sub_rule("backbone.", "encoder.")]``.

    Returns:
        A new dict of the same type, str keys renamed (others kept), ``_metadata`` kept
        in step.

    Raises:
        KeyCollisionError: two keys would become one.
        UsageError: ``rules`` is not a :class:`KeyRule` or a sequence of them.

    Example:
        >>> rename_keys({"a.w": 1}, [sub_rule("a.", "b.")])
        {'b.w': 1}
    """
    rules = rule_items(rules)
    # Rules rename str keys; others (0, (1, 2)) stay as they are, as a file's rewrite keeps them.
    return apply_plan(sd, plan_renames([k for k in sd if isinstance(k, str)], rules), rules)


def key_heads(keys: Iterable[Any]) -> list[str]:
    """How the keys start, to say so where a prefix matches none: each key's first part
    with its dot, a key without a dot whole (``fc``: ``fc.`` would claim a prefix), sorted.

    Example:
        >>> key_heads(["conv1.weight", "conv1.bias", "fc"])
        ['conv1.', 'fc']
    """
    return sorted({str(k).partition(".")[0] + ("." if "." in str(k) else "") for k in keys})
