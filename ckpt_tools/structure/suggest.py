"""Which key rewrite makes one set of state-dict keys match another. Torch-free.

Two ways to find one, both built from :data:`ckpt_tools.structure.keys.WRAPPER_RULES` and applied by
:func:`ckpt_tools.structure.keys.plan_renames`:

* :func:`layout_fix` compares the wrapper stacks of both sides (``module._orig_mod.`` vs
  ``_orig_mod.``): strip what only the source carries, add what only the target carries.
* :func:`rank_fixes` also tries each wrapper rule alone (strip, strip inside keys, add) and
  the prefix maps that turn a top-level name of the source into one of the target
  (``backbone.`` -> ``encoder.``), and ranks all by how many keys they make match.

:func:`ckpt_tools.loading.into_module.load_into` applies the best wrapper rewrite; ``ckpt diff``
prints the ranking as suggestions.
"""

from __future__ import annotations

import os
import re
import shlex
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools.errors import KeyCollisionError
from ckpt_tools.structure.keys import (
    WRAPPER_RULES,
    KeyRule,
    WrapperMatch,
    add_rule,
    detect_wrappers,
    plan_renames,
    strip_rule,
    sub_rule,
)

__all__ = [
    "KeyFix",
    "Step",
    "best_fix",
    "fix_command",
    "fix_python",
    "layout_fix",
    "rank_fixes",
    "wrapper_stack",
]


@dataclass(frozen=True)
class Step:
    """One rewrite of the source's keys.

    Attributes:
        action: ``"strip"`` (at the start), ``"strip-inner"`` (everywhere in the key),
            ``"add"`` (in front) or ``"sub"`` (replace a leading ``prefix`` by ``new``).
        prefix: the text stripped, added or replaced (``module.``).
        new: the replacement, for ``sub``.
    """

    action: str
    prefix: str
    new: str = ""

    @property
    def rule(self) -> KeyRule:
        if self.action == "strip":
            return strip_rule(self.prefix)
        if self.action == "strip-inner":
            return strip_rule(self.prefix, inner=True)
        if self.action == "add":
            return add_rule(self.prefix)
        return sub_rule(self.prefix, self.new)

    @property
    def inverse(self) -> Step:
        """The same change made to the other side instead (strip here = add there)."""
        if self.action == "add":
            return Step("strip", self.prefix)
        if self.action == "sub":
            return Step("sub", self.new, self.prefix)
        return Step("add", self.prefix)

    def describe(self) -> str:
        if self.action == "sub":
            return f"renaming {self.prefix!r} to {self.new!r}"
        verb = {"strip": "stripping", "strip-inner": "stripping", "add": "adding"}[self.action]
        return f"{verb} {self.prefix!r}" + (" everywhere" if self.action == "strip-inner" else "")


@dataclass(frozen=True)
class KeyFix:
    """A rewrite of the source keys, and how well it matches the target keys.

    Attributes:
        steps: applied in order.
        resolved: source keys without a match before that have one after.
        unmatched: source keys without a match before (the ``of`` in "resolves 3 of 4").
        matched: source keys with a match after.
        broken: source keys with a match before that lose it.
    """

    steps: tuple[Step, ...]
    resolved: int
    unmatched: int
    matched: int
    broken: int = 0

    @property
    def rules(self) -> tuple[KeyRule, ...]:
        return tuple(step.rule for step in self.steps)

    @property
    def complete(self) -> bool:
        """Every source key that lacked a match has one, and none lost theirs."""
        return self.resolved == self.unmatched and not self.broken

    def describe(self) -> str:
        """``stripping 'module.', then adding '_orig_mod.'``."""
        return ", then ".join(step.describe() for step in self.steps)


def wrapper_stack(keys: Iterable[str]) -> tuple[WrapperMatch, ...]:
    """The wrapper prefixes at the start of ``keys``, outermost first (inner ones left out).

    Example:
        >>> [m.prefix for m in wrapper_stack(["module._orig_mod.fc.weight"])]
        ['module.', '_orig_mod.']
    """
    return tuple(m for m in detect_wrappers(keys) if not m.inner)


def layout_fix(source: Sequence[str], target: Sequence[str]) -> tuple[Step, ...]:
    """The steps that turn the wrapper stack of ``source`` keys into that of ``target`` keys.

    The stacks are compared from the inside: the common innermost wrappers stay, the
    source's outer ones are stripped, the target's outer ones are added. Wrappers nested
    inside keys (FSDP, activation checkpointing) only the source carries are stripped too.

    Args:
        source: keys to rewrite (a checkpoint's).
        target: keys to match (a model's).

    Returns:
        The steps, possibly none.

    Example:
        >>> [s.describe() for s in layout_fix(["module.fc.w"], ["_orig_mod.fc.w"])]
        ["stripping 'module.'", "adding '_orig_mod.'"]
    """
    src = [m.prefix for m in wrapper_stack(source)]
    dst = [m.prefix for m in wrapper_stack(target)]
    common = 0
    while common < min(len(src), len(dst)) and src[-1 - common] == dst[-1 - common]:
        common += 1
    steps = [Step("strip", p) for p in src[: len(src) - common]]
    steps += [Step("add", p) for p in reversed(dst[: len(dst) - common])]
    target_inner = {m.prefix for m in detect_wrappers(target) if m.inner}
    for match in detect_wrappers(source):
        if match.inner and match.prefix not in target_inner:
            steps.append(Step("strip-inner", match.prefix))
    return tuple(steps)


def _evaluate(
    steps: tuple[Step, ...],
    source: Sequence[str],
    target: set[str],
    same_shape: Callable[[str, str], bool] | None = None,
) -> KeyFix | None:
    try:
        plan = plan_renames(source, [step.rule for step in steps])
    except KeyCollisionError:
        return None
    before = {k for k in source if k in target}
    # A key renamed onto a tensor of another shape is not a match: it would fail to load.
    after = {
        k for k, new in plan.items() if new in target and (same_shape is None or same_shape(k, new))
    }
    return KeyFix(
        steps=steps,
        resolved=len(after - before),
        unmatched=len(source) - len(before),
        matched=len(after),
        broken=len(before - after),
    )


def _prefixes(key: str, depth: int = 2) -> list[str]:
    """The first ``depth`` dotted prefixes of ``key`` that leave something after them."""
    parts = key.split(".")
    return [".".join(parts[:n]) + "." for n in range(1, min(depth, len(parts) - 1) + 1)]


def _candidates(source: Sequence[str], target: Sequence[str], subs: bool) -> list[tuple[Step, ...]]:
    """Candidate rewrites, most trusted first: the layout fix, wrapper rules, key prefixes."""
    found: list[tuple[Step, ...]] = [layout_fix(source, target)]
    for rule in WRAPPER_RULES:
        found.append((Step("strip", rule.prefix),))
        if rule.inner:
            found.append((Step("strip-inner", rule.prefix),))
        found.append((Step("add", rule.prefix),))
    if subs:
        target_set, source_set = set(target), set(source)
        extra = Counter(p for k in source if k not in target_set for p in _prefixes(k))
        missing = Counter(p for k in target if k not in source_set for p in _prefixes(k))
        olds = [p for p, _ in extra.most_common(6)]
        news = [p for p, _ in missing.most_common(6)]
        found += [(Step("strip", old),) for old in olds]
        found += [(Step("add", new),) for new in news]
        found += [(Step("sub", old, new),) for old in olds for new in news if old != new]
    return list(dict.fromkeys(s for s in found if s))


def rank_fixes(
    source: Sequence[str],
    target: Sequence[str],
    subs: bool = True,
    shapes: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> tuple[KeyFix, ...]:
    """Every candidate rewrite of ``source`` that gains matches with ``target``, best first.

    Candidates: the :func:`layout_fix`, each wrapper rule alone (strip, strip inside keys,
    add) and, with ``subs``, the leading one- and two-segment prefixes of the unmatched keys
    of both sides: stripped from the source, added to it, or mapped onto each other
    (``backbone.`` -> ``encoder.``). Rewrites that would merge two keys are dropped.

    Args:
        source: keys to rewrite.
        target: keys to match.
        subs: also try prefixes taken from the keys (``backbone.`` -> ``encoder.``).
        shapes: ``(source shapes, target shapes)`` by key; when given, a key only counts as
            matched when its shape agrees with the one it is renamed onto.

    Returns:
        The fixes that make more source keys match than before, by matches gained (then
        wrapper rewrites before rewrites made of the keys' own prefixes).

    Example:
        >>> rank_fixes(["module.a", "module.b"], ["a", "b"])[0].describe()
        "stripping 'module.'"
    """
    target_set = set(target)
    same_shape = None
    if shapes is not None:
        shape_src, shape_dst = shapes

        def same_shape(old: str, new: str) -> bool:
            return shape_src.get(old) == shape_dst.get(new)

    fixes = []
    for steps in _candidates(source, target, subs):
        fix = _evaluate(steps, source, target_set, same_shape)
        if fix is not None and fix.resolved > fix.broken:
            fixes.append(fix)
    # Most matches gained first; among equals, the candidates' order (wrappers first), which
    # the sort keeps because it is stable.
    fixes.sort(key=lambda f: -(f.resolved - f.broken))
    return tuple(fixes)


def best_fix(source: Sequence[str], target: Sequence[str]) -> KeyFix | None:
    """The wrapper rewrite (no prefix maps) that makes the most ``source`` keys match.

    Returns:
        The best :class:`KeyFix`, or None when the keys already match as well as they can.

    Example:
        >>> best_fix(["fc.w"], ["model.fc.w"]).describe()
        "adding 'model.'"
    """
    fixes = rank_fixes(source, target, subs=False)
    return fixes[0] if fixes else None


def _collapse(steps: Sequence[Step]) -> tuple[str, str, list[str], list[Step]]:
    """Leading strips and adds as one prefix map ``old -> new``, plus inner strips, plus subs."""
    old = "".join(s.prefix for s in steps if s.action == "strip")
    new = "".join(s.prefix for s in reversed(steps) if s.action == "add")
    inner = [s.prefix for s in steps if s.action == "strip-inner"]
    subs = [s for s in steps if s.action == "sub"]
    return old, new, inner, subs


def _inner_pattern(prefix: str) -> str:
    # No '=' in it: `ckpt rename --regex PATTERN=REPL` splits at the first '='.
    return rf"\b{re.escape(prefix)}"


def _out_path(path: str) -> str:
    stem, suffix = os.path.splitext(path.rstrip("/"))
    return f"{stem}.renamed{suffix}"


def fix_command(
    path: str,
    steps: Sequence[Step],
    select: str | Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
) -> str:
    """The ``ckpt`` command that applies ``steps`` to the checkpoint file at ``path``.

    Args:
        path: the checkpoint to rewrite.
        steps: a fix's steps.
        select: the ``--select`` the state dict was chosen with, if any.
        keys: the file's keys; when the steps strip exactly the wrappers found in them, the
            command is plain ``ckpt strip-module IN OUT``.

    Returns:
        One shell command line (arguments quoted), writing ``<stem>.renamed<suffix>``.

    Example:
        >>> fix_command("ddp.pt", [Step("strip", "module.")], keys=["module.w"])
        'ckpt strip-module ddp.pt ddp.renamed.pt'
    """
    old, new, inner, subs = _collapse(steps)
    args: list[str]
    out = _out_path(path)
    if subs or inner or (old and new):
        args = ["ckpt", "rename", path, out]
        if old:
            args += ["--sub", f"{old}={new}"]
        elif new:
            args += ["--regex", f"^={new}"]
        for step in subs:
            args += ["--sub", f"{step.prefix}={step.new}"]
        for prefix in inner:
            args += ["--regex", f"{_inner_pattern(prefix)}="]
        if not subs and not (old and new) and keys is not None:
            found = [
                ("strip-inner" if m.inner else "strip", m.prefix) for m in detect_wrappers(keys)
            ]
            if found == [(s.action, s.prefix) for s in steps]:
                args = ["ckpt", "strip-module", path, out]
    elif new:
        args = ["ckpt", "add-module", path, out]
        if new != "module.":
            args += ["--prefix", new]
    else:
        args = ["ckpt", "strip-module", path, out]
        stripped_all = keys is not None and [m.prefix for m in detect_wrappers(keys)] == [
            s.prefix for s in steps
        ]
        if not stripped_all:
            args += ["--prefix", old]
    if select is not None:
        args += ["--select", select if isinstance(select, str) else ".".join(select)]
    return " ".join(shlex.quote(a) for a in args)


def fix_python(steps: Sequence[Step], name: str = "sd") -> str:
    """The Python call that applies ``steps`` to an in-memory state dict called ``name``.

    Example:
        >>> fix_python([Step("add", "module.")])
        "ckpt_tools.add_prefix(sd, prefix='module.')"
    """
    old, new, inner, subs = _collapse(steps)
    if not subs and not inner and not (old and new):
        if new:
            return f"ckpt_tools.add_prefix({name}, prefix={new!r})"
        return f"ckpt_tools.strip_prefix({name}, prefix={old!r})"
    rules = [f"ckpt_tools.sub_rule({old!r}, {new!r})"] if old or new else []
    rules += [f"ckpt_tools.sub_rule({s.prefix!r}, {s.new!r})" for s in subs]
    rules += [f"ckpt_tools.regex_rule({_inner_pattern(p)!r}, '')" for p in inner]
    return f"ckpt_tools.rename_keys({name}, [{', '.join(rules)}])"
