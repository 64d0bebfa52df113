"""Which key rewrite makes one set of state-dict keys match another. Torch-free.

Candidates are built from :data:`ckpt_tools.structure.wrappers.WRAPPER_RULES` and from the keys'
own prefixes:

* :func:`layout_fix` compares the wrapper stacks of both sides (``module._orig_mod.`` vs
  ``_orig_mod.``): strip what only the source carries, add what only the target carries.
* :func:`path_fix` moves wrappers that sit at some module paths on one side and not the
  other (a child compiled on its own: ``blocks.1._orig_mod.weight`` vs ``blocks.1.weight``).
* :func:`rank_fixes` also tries each wrapper rule alone (strip, strip inside keys, add) and
  the prefix maps that turn a top-level name of the source into one of the target
  (``backbone.`` -> ``encoder.``), and ranks all by how many keys they make match.

A candidate is kept only if the rules its command applies
(:func:`ckpt_tools.structure.steps.step_rules`, through
:func:`ckpt_tools.structure.keys.plan_renames`) rename no key that already matched, and send
every key they make match to the same tensor with its wrappers moved, where there is one
(:func:`wrapper_partners`): ``blocks.0.weight`` is never "resolved" onto ``blocks.1.weight``.

:func:`ckpt_tools.loading.into_module.load_into` applies the best wrapper rewrite; ``ckpt diff``
prints the ranking as suggestions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools.errors import KeyCollisionError
from ckpt_tools.structure.keys import KeyRule, idle_rules, plan_renames, sub_rule
from ckpt_tools.structure.partners import wrapper_partners
from ckpt_tools.structure.steps import Step, fix_command, fix_python, step_rules
from ckpt_tools.structure.wrappers import (
    WRAPPER_RULES,
    WrapperMatch,
    WrapperRule,
    detect_wrappers,
)

__all__ = [
    "MAX_PATH_RULES",
    "KeyFix",
    "Step",
    "best_fix",
    "check_fix",
    "fix_command",
    "fix_python",
    "layout_fix",
    "path_fix",
    "rank_fixes",
    "wrapper_partners",
    "wrapper_stack",
]

#: The most prefix maps :func:`path_fix` offers: one per module path whose wrappers differ
#: (each compiled child), each a pass over every key and an option on the command line.
MAX_PATH_RULES = 64


@dataclass(frozen=True)
class KeyFix:
    """A rewrite of the source keys, and how well it matches the target keys.

    Attributes:
        steps: what the rewrite does, in words' order; :attr:`rules` are what it applies.
        resolved: source keys without a match before that have one after.
        unmatched: source keys without a match before (the ``of`` in "resolves 3 of 4").
        matched: source keys with a match after.
        broken: source keys with a match before that lose it (0 for every fix offered:
            a rewrite that renames a matching key is not one).
    """

    steps: tuple[Step, ...]
    resolved: int
    unmatched: int
    matched: int
    broken: int = 0

    @property
    def rules(self) -> tuple[KeyRule, ...]:
        """The rules, in the order they apply: those :func:`fix_command`'s command applies."""
        return step_rules(self.steps)

    @property
    def complete(self) -> bool:
        """Every source key that lacked a match has one, and none lost theirs."""
        return self.resolved == self.unmatched and not self.broken

    def describe(self) -> str:
        """``stripping 'module.', then adding '_orig_mod.'``."""
        return ", then ".join(step.describe() for step in self.steps)


def wrapper_stack(
    keys: Iterable[str],
    *,
    anywhere: bool = False,
    wrappers: Sequence[WrapperRule] = WRAPPER_RULES,
) -> tuple[WrapperMatch, ...]:
    """The wrapper prefixes at the start of ``keys``, outermost first (inner ones left out;
    ``anywhere`` and ``wrappers`` as :func:`~ckpt_tools.structure.wrappers.detect_wrappers`
    takes them).

    Example:
        >>> [m.prefix for m in wrapper_stack(["module._orig_mod.fc.weight"])]
        ['module.', '_orig_mod.']
    """
    found = detect_wrappers(keys, anywhere=anywhere, wrappers=wrappers)
    return tuple(m for m in found if not m.inner)


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
    steps = list(_leading_fix(source, target))
    target_inner = {m.prefix for m in detect_wrappers(target) if m.inner}
    for match in detect_wrappers(source):
        if match.inner and match.prefix not in target_inner:
            steps.append(Step("strip-inner", match.prefix))
    return tuple(steps)


def _leading_fix(source: Sequence[str], target: Sequence[str]) -> tuple[Step, ...]:
    """:func:`layout_fix`'s strips and adds: the wrapper stacks at the start of the keys."""
    # Both stacks peeled alike (a model's own `model.` included), then compared from inside.
    src = [m.prefix for m in wrapper_stack(source, anywhere=True)]
    dst = [m.prefix for m in wrapper_stack(target, anywhere=True)]
    common = 0
    while common < min(len(src), len(dst)) and src[-1 - common] == dst[-1 - common]:
        common += 1
    steps = [Step("strip", p) for p in src[: len(src) - common]]
    steps += [Step("add", p) for p in reversed(dst[: len(dst) - common])]
    return tuple(steps)


def _moved_prefix(old: str, new: str) -> tuple[str, str]:
    """The leading prefixes that differ between two keys, after their longest common run of
    trailing segments: ``blocks.1.weight``, ``blocks.1._orig_mod.weight`` ->
    ``('blocks.1.', 'blocks.1._orig_mod.')``."""
    a, b = old.split("."), new.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[-1 - common] == b[-1 - common]:
        common += 1
    if common == 0 or common == len(a):
        return "", ""  # nothing shared, or nothing of ``old`` left to map: no prefix map
    rest = b[: len(b) - common]
    return ".".join(a[: len(a) - common]) + ".", (".".join(rest) + "." if rest else "")


def path_fix(source: Sequence[str], target: Sequence[str]) -> tuple[Step, ...]:
    """The steps that move wrappers where only some module paths carry them.

    A child compiled on its own (``model.blocks[1] = torch.compile(model.blocks[1])``) puts
    ``_orig_mod.`` inside its keys only. After the wrapper stacks at the start are matched
    (:func:`layout_fix`'s strips and adds), each :func:`wrapper_partners` pair that still
    differs gives the prefix map that turns one into the other, at the path where they differ
    (``blocks.1._orig_mod.`` -> ``blocks.1.``, ``blocks.0.`` -> ``blocks.0._orig_mod.``).

    Args:
        source: keys to rewrite.
        target: keys to match.

    Returns:
        The steps, in the order :func:`~ckpt_tools.structure.steps.step_rules` applies them;
        none when the pairs need no prefix map, or one that is no prefix, or more than
        :data:`MAX_PATH_RULES`. Whether they work is for :func:`check_fix` to say.

    Example:
        >>> [s.describe() for s in path_fix(["a.w", "b.w"], ["a.w", "b._orig_mod.w"])]
        ["renaming 'b.' to 'b._orig_mod.'"]
    """
    lead = _leading_fix(source, target)
    old = "".join(s.prefix for s in lead if s.action == "strip")
    new = "".join(s.prefix for s in reversed(lead) if s.action == "add")
    if old:  # the merged leading map applies first, then these maps
        try:
            source = list(plan_renames(source, [sub_rule(old, new)]).values())
        except KeyCollisionError:
            return ()
    else:  # the add applies after these maps: match the target without it
        target = [k[len(new) :] if k.startswith(new) else k for k in target]
    maps: dict[tuple[str, str], None] = {}
    for key, partner in wrapper_partners(source, target).items():
        moved = _moved_prefix(key, partner)
        if not moved[0]:
            return ()
        maps[moved] = None
    if not maps or len(maps) > MAX_PATH_RULES:
        return ()
    subs = tuple(Step("sub", a, b) for a, b in maps)
    return (*lead, *subs) if old else (*subs, *lead)


def check_fix(
    steps: Sequence[Step],
    source: Sequence[str],
    target: Sequence[str],
    shapes: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> KeyFix | None:
    """How well ``steps`` make ``source`` match ``target``, or None where they are wrong.

    The steps' :func:`~ckpt_tools.structure.steps.step_rules` (what their command applies)
    rename the keys. They are wrong if they merge two keys, rename a key that already
    matched, or make a key match another than its :func:`wrapper_partners` partner (or a
    key without one match a partner of another key).

    Args:
        steps: the rewrite.
        source: keys to rewrite.
        target: keys to match.
        shapes: ``(source shapes, target shapes)`` by key; when given, a key only counts as
            matched when its shape agrees with the one it is renamed onto.

    Returns:
        The :class:`KeyFix`, or None.

    Example:
        >>> check_fix([Step("sub", "b.0.", "b.1.")], ["b.0.w"], ["b.0._orig_mod.w", "b.1.w"])
        >>> check_fix([Step("strip", "module.")], ["module.w"], ["w"]).complete
        True
    """
    checked = _checked(tuple(steps), source, set(target), wrapper_partners(source, target), shapes)
    return checked[0] if checked is not None else None


def _checked(
    steps: tuple[Step, ...],
    source: Sequence[str],
    target: set[str],
    partners: Mapping[str, str],
    shapes: tuple[Mapping[str, Any], Mapping[str, Any]] | None,
) -> tuple[KeyFix, frozenset[tuple[str, str]]] | None:
    """:func:`check_fix`, with the ``(key, new key)`` pairs the fix makes match."""
    rules = step_rules(steps)
    if idle_rules(source, rules):  # its command would be refused, its words untrue
        return None
    try:
        plan = plan_renames(source, rules)
    except KeyCollisionError:
        return None
    before = {k for k in source if k in target}
    if any(plan[k] != k for k in before):
        return None
    taken = set(partners.values())
    gained = set()
    for key, new in plan.items():
        if key in before or new not in target:
            continue
        if partners.get(key, new) != new or (key not in partners and new in taken):
            return None  # the right name for another tensor
        # A key renamed onto a tensor of another shape is not a match: it would fail to load.
        if shapes is None or shapes[0].get(key) == shapes[1].get(new):
            gained.add((key, new))
    fix = KeyFix(steps, len(gained), len(source) - len(before), len(before) + len(gained))
    return fix, frozenset(gained)


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
    add), the :func:`path_fix` where none of those makes every key match, and, with
    ``subs``, the leading one- and two-segment prefixes of the unmatched keys of both sides:
    stripped from the source, added to it, or mapped onto each other (``backbone.`` ->
    ``encoder.``). Only those :func:`check_fix` finds right are kept.

    Args:
        source: keys to rewrite.
        target: keys to match.
        subs: also try prefixes taken from the keys (``backbone.`` -> ``encoder.``).
        shapes: ``(source shapes, target shapes)`` by key; when given, a key only counts as
            matched when its shape agrees with the one it is renamed onto.

    Returns:
        The fixes that make more source keys match than before, by matches gained (then
        wrapper rewrites before rewrites made of the keys' own prefixes). A fix whose
        matches an earlier fix makes too, each key onto the same key, is left out: it says
        nothing more.

    Example:
        >>> rank_fixes(["module.a", "module.b"], ["a", "b"])[0].describe()
        "stripping 'module.'"
    """
    target_set = set(target)
    partners = wrapper_partners(source, target)
    candidates = _candidates(source, target, subs)
    checked = [_checked(steps, source, target_set, partners, shapes) for steps in candidates]
    kept = [pair for pair in checked if pair is not None and pair[0].resolved]
    moved = path_fix(source, target) if not any(f.complete for f, _ in kept) else ()
    if moved and moved not in candidates:
        pair = _checked(moved, source, target_set, partners, shapes)
        kept += [pair] if pair is not None and pair[0].resolved else []
    # Most matches gained first; among equals, the candidates' order (wrappers first), which
    # the sort keeps because it is stable.
    kept.sort(key=lambda pair: -pair[0].resolved)
    out: list[KeyFix] = []
    shown: list[frozenset[tuple[str, str]]] = []
    for fix, gained in kept:
        if not any(gained <= earlier for earlier in shown):
            out.append(fix)
            shown.append(gained)
    return tuple(out)


def best_fix(source: Sequence[str], target: Sequence[str]) -> KeyFix | None:
    """The wrapper rewrite (no prefix maps of the keys' own names) that makes the most
    ``source`` keys match.

    Args:
        source: keys to rewrite.
        target: keys to match.

    Returns:
        The best :class:`KeyFix` of :func:`rank_fixes` without ``subs``, or None when no
        wrapper rewrite makes more keys match without renaming one that did.

    Example:
        >>> best_fix(["fc.w"], ["model.fc.w"]).describe()
        "adding 'model.'"
        >>> best_fix(["b.0.w", "b.1.w"], ["b.0.w", "b.1._orig_mod.w"]).describe()
        "renaming 'b.1.' to 'b.1._orig_mod.'"
    """
    fixes = rank_fixes(source, target, subs=False)
    return fixes[0] if fixes else None
