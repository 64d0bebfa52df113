"""Wrapper prefixes and key rewrites, as data, applied by one generic function.

:data:`WRAPPER_RULES` lists what training wrappers add to state-dict keys; a
:class:`KeyRule` is one regex substitution; :func:`plan_renames` applies a list of rules
to a list of keys (and refuses collisions); everything else here builds rules or applies a
plan to an in-memory state dict.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ckpt_tools._types import items_of
from ckpt_tools.errors import KeyCollisionError, Remedy, ResourceLimitError, UsageError

__all__ = [
    "MAX_WRAPPER_DEPTH",
    "WRAPPER_RULES",
    "KeyRule",
    "WrapperMatch",
    "WrapperRule",
    "add_prefix",
    "add_rule",
    "apply_plan",
    "compile_pattern",
    "detect_wrappers",
    "plan_renames",
    "regex_rule",
    "rename_keys",
    "rule_items",
    "strip_prefix",
    "strip_rule",
    "strip_wrapper_rules",
    "sub_rule",
]


@dataclass(frozen=True)
class WrapperRule:
    """What one training wrapper adds to keys.

    Attributes:
        prefix: the text it adds, ending in ``.``.
        kind: who adds it, in words.
        inner: it may appear inside a key (``blocks.0._checkpoint_wrapped_module.fc``), not
            only at the start.
        whole: report it as a prefix only when every key with a dot carries it
            (``module.`` and ``model.`` are also common plain attribute names; a key without
            a dot, an ``epoch`` beside the weights, names no module's tensor).
    """

    prefix: str
    kind: str
    inner: bool = False
    whole: bool = False


WRAPPER_RULES: tuple[WrapperRule, ...] = (
    # DataParallel and DDP prefix every key; some keys under module. are an attribute of that
    # name (an EMA helper's self.module), which stripping would break.
    WrapperRule("module.", "nn.DataParallel / DistributedDataParallel", whole=True),
    WrapperRule("_orig_mod.", "torch.compile", inner=True),
    WrapperRule("_fsdp_wrapped_module.", "FullyShardedDataParallel", inner=True),
    WrapperRule("_checkpoint_wrapped_module.", "activation checkpoint_wrapper", inner=True),
    WrapperRule("_forward_module.", "Lightning Fabric / DeepSpeed _forward_module", inner=True),
    WrapperRule("base_model.model.", "PEFT PeftModel", whole=True),
    WrapperRule("model.", "Lightning module attribute `model`", whole=True),
)


#: The most wrapper prefixes :func:`detect_wrappers` peels from the start of keys. Training
#: wrappers stack a few; each layer costs a pass over every key and a rule in every rewrite.
MAX_WRAPPER_DEPTH = 32


@dataclass(frozen=True)
class WrapperMatch:
    """A wrapper found in a set of keys.

    Attributes:
        prefix: the wrapper's text (``module.``).
        kind: who adds it.
        count: keys that carry it.
        of: keys looked at.
        inner: found inside keys rather than at their start.
    """

    prefix: str
    kind: str
    count: int
    of: int
    inner: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "kind": self.kind, "count": self.count, "of": self.of}


def detect_wrappers(keys: Iterable[str]) -> tuple[WrapperMatch, ...]:
    """Find the wrapper prefixes a set of state-dict keys carries, outermost first.

    Stacked wrappers are peeled one layer at a time (``module._orig_mod.fc.weight`` gives
    ``module.`` then ``_orig_mod.``). Wrappers that nest inside the tree (FSDP, activation
    checkpointing) are also counted where they appear inside keys.

    Args:
        keys: state-dict keys.

    Returns:
        The matches, outermost prefix first, then inner ones.

    Raises:
        ResourceLimitError: keys start with more than :data:`MAX_WRAPPER_DEPTH` wrappers.

    Example:
        >>> [m.prefix for m in detect_wrappers(["module._orig_mod.fc.weight"])]
        ['module.', '_orig_mod.']
    """
    current = [k for k in keys if isinstance(k, str)]
    total = len(current)
    found: list[WrapperMatch] = []
    peeled: set[str] = set()
    while current:
        for rule in WRAPPER_RULES:
            count = sum(k.startswith(rule.prefix) for k in current)
            # A key without a dot (`epoch` beside the weights) is no module's: it does not
            # count against a prefix every module key must carry.
            if count and (not rule.whole or count == sum("." in k for k in current)):
                if len(found) == MAX_WRAPPER_DEPTH:
                    raise _too_deep(rule.prefix)
                found.append(WrapperMatch(rule.prefix, rule.kind, count, total))
                peeled.add(rule.prefix)
                current = [
                    k[len(rule.prefix) :] if k.startswith(rule.prefix) else k for k in current
                ]
                break
        else:
            break
    for rule in WRAPPER_RULES:
        if not rule.inner:
            continue
        count = sum(f".{rule.prefix}" in k for k in current)
        if count:
            found.append(WrapperMatch(rule.prefix, rule.kind, count, total, inner=True))
    return tuple(found)


def _too_deep(prefix: str) -> ResourceLimitError:
    return ResourceLimitError(
        f"keys start with more than {MAX_WRAPPER_DEPTH} wrapper prefixes (the next is "
        f"{prefix!r}); training wrappers stack a few, so these are not a model's keys"
    )


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

    def apply(self, key: str) -> str:
        return re.sub(self.pattern, self.replacement, key, count=self.count)


def strip_rule(prefix: str, inner: bool = False) -> KeyRule:
    """A rule removing ``prefix`` at the start of keys (and, with ``inner``, after any dot)."""
    if inner:
        return KeyRule(rf"(^|(?<=\.)){re.escape(prefix)}", "", 0, f"strip {prefix!r} everywhere")
    return KeyRule(f"^{re.escape(prefix)}", "", 1, f"strip {prefix!r}")


def add_rule(prefix: str) -> KeyRule:
    """A rule putting ``prefix`` in front of every key."""
    return KeyRule("^", prefix.replace("\\", "\\\\"), 1, f"add {prefix!r}")


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
    return KeyRule(f"^{re.escape(old)}", new.replace("\\", "\\\\"), 1, f"{old!r} -> {new!r}")


def regex_rule(pattern: str, replacement: str) -> KeyRule:
    """A regex substitution on every key (all matches), as ``re.sub`` makes it.

    Args:
        pattern: a regular expression.
        replacement: its replacement (``\\1`` for groups).

    Returns:
        The :class:`KeyRule`, for :func:`rename_keys` or ``ckpt_tools.rename(..., rules=)``.

    Raises:
        UsageError: the pattern does not compile.

    Example:
        >>> rename_keys({"blocks.0.w": 1}, [regex_rule(r"^blocks\\.", "layers.")])
        {'layers.0.w': 1}
    """
    compile_pattern(pattern, argument="pattern", flag="--regex pattern")
    return KeyRule(pattern, replacement, 0, f"s/{pattern}/{replacement}/")


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


def strip_wrapper_rules(
    keys: Iterable[str],
) -> tuple[tuple[KeyRule, ...], tuple[WrapperMatch, ...]]:
    """The rules that strip every wrapper :func:`detect_wrappers` finds in ``keys``."""
    matches = detect_wrappers(keys)
    rules = tuple(strip_rule(m.prefix, inner=m.inner) for m in matches)
    return rules, matches


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
        new = key
        for rule in rules:
            new = rule.apply(new)
        plan[key] = new
        sources.setdefault(new, []).append(key)
    collisions = tuple((new, tuple(olds)) for new, olds in sources.items() if len(olds) > 1)
    if collisions:
        shown = "; ".join(
            f"{' and '.join(map(repr, olds))} -> {new!r}" for new, olds in collisions[:3]
        )
        raise KeyCollisionError(
            f"the rewrite would merge {len(collisions)} pair(s) of keys into one: {shown}"
            f"{' ...' if len(collisions) > 3 else ''}",
            collisions,
            remedies=(
                Remedy(text="remove the duplicates first"),
                Remedy(command="ckpt rename IN OUT --sub OLD=NEW", text="to rename one side"),
            ),
        )
    return plan


_SD = TypeVar("_SD", bound=Mapping[str, Any])


def apply_plan(sd: Mapping[str, Any], plan: Mapping[str, str], rules: Sequence[KeyRule]) -> dict:
    """A new dict: keys renamed by ``plan``, same values and order, ``_metadata`` kept in step.

    Module paths in ``_metadata`` are renamed by the same ``rules`` (as torch's
    ``consume_prefix_in_state_dict_if_present`` does for ``module.``).
    """
    out = type(sd)() if isinstance(sd, dict) else {}
    for key, value in sd.items():
        out[plan.get(key, key)] = value
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None:
        renamed = type(metadata)()
        for path, value in metadata.items():
            new = f"{path}." if path else ""
            for rule in rules:
                new = rule.apply(new)
            new = new[:-1] if new.endswith(".") else new
            if not path and new:
                # The root moved under wrappers (add 'module.'): each wrapper, from the new
                # root down, gets an entry too, first, as a wrapped model's state_dict() has.
                parts = new.split(".")
                for depth in range(len(parts)):
                    renamed[".".join(parts[:depth])] = copy.copy(value)
            if new != path or new not in renamed:
                # A renamed entry wins over one already there, as in torch's
                # consume_prefix_in_state_dict_if_present ('module' replaces DDP's own '').
                renamed[new] = value
        out._metadata = renamed  # type: ignore[attr-defined]
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
        A new dict of the same type, keys renamed, ``_metadata`` kept in step.

    Raises:
        KeyCollisionError: two keys would become one.
        UsageError: ``rules`` is not a :class:`KeyRule` or a sequence of them.

    Example:
        >>> rename_keys({"a.w": 1}, [sub_rule("a.", "b.")])
        {'b.w': 1}
    """
    rules = rule_items(rules)
    return apply_plan(sd, plan_renames(list(sd), rules), rules)


def strip_prefix(sd: Mapping[str, Any], *, prefix: str = "module.") -> dict:
    """Remove ``prefix`` from the keys that start with it (nn.DataParallel / DDP -> plain).

    Args:
        sd: a state dict (values are left as they are, tensors are not copied).
        prefix: the prefix to remove.

    Returns:
        A new dict of the same type, keys stripped, ``_metadata`` kept in step.

    Raises:
        KeyCollisionError: stripping would merge two keys.

    Example:
        >>> strip_prefix({"module.fc.weight": 0})
        {'fc.weight': 0}
    """
    return rename_keys(sd, [strip_rule(prefix)])


def add_prefix(sd: Mapping[str, Any], *, prefix: str = "module.") -> dict:
    """Put ``prefix`` in front of every key (plain -> nn.DataParallel / DDP layout).

    ``_metadata`` gains the wrapper's own root entry, as a wrapped model's state dict has.

    Args:
        sd: a state dict (values are left as they are, tensors are not copied).
        prefix: the prefix to add.

    Returns:
        A new dict of the same type, keys prefixed.

    Raises:
        KeyCollisionError: never in practice (a prefix keeps distinct keys distinct); as
            :func:`rename_keys`.

    Example:
        >>> add_prefix({"fc.weight": 0})
        {'module.fc.weight': 0}
    """
    return rename_keys(sd, [add_rule(prefix)])
