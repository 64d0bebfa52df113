"""A key rewrite as steps, and the one order they apply in. Torch-free.

A :class:`Step` strips, adds or maps one prefix. :func:`step_rules` turns steps into the
:class:`~ckpt_tools.structure.keys.KeyRule` s that ``ckpt rename`` would apply (its prefix maps
first, then its regex substitutions), and :func:`fix_command` and :func:`fix_python` render
those very rules. Whoever checks a rewrite checks :func:`step_rules`, so what was checked is
what the printed command does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ckpt_tools._escape import not_an_option, shell_word
from ckpt_tools.errors import KeyCollisionError
from ckpt_tools.structure.keys import (
    KeyRule,
    add_rule,
    literal_replacement,
    plan_renames,
    regex_rule,
    strip_rule,
    sub_rule,
)
from ckpt_tools.structure.paths import select_text
from ckpt_tools.structure.wrappers import (
    FILE_DEPENDENT_PREFIXES,
    detect_wrappers,
    strip_wrapper_rules,
)

__all__ = ["Step", "fix_command", "fix_python", "on_stored", "step_rules"]


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


def _collapse(steps: Sequence[Step]) -> tuple[str, str, list[str], list[Step]]:
    """Leading strips and adds as one prefix map ``old -> new``, plus inner strips, plus subs."""
    old = "".join(s.prefix for s in steps if s.action == "strip")
    new = "".join(s.prefix for s in reversed(steps) if s.action == "add")
    inner = [s.prefix for s in steps if s.action == "strip-inner"]
    subs = [s for s in steps if s.action == "sub"]
    return old, new, inner, subs


def _prefix_maps(steps: Sequence[Step]) -> list[tuple[str, str]]:
    """The prefix maps of ``steps``, in the order they apply: the subs before the first strip
    (a rename inside a wrapper's prefix, then the strip), the merged strips and adds, the
    other subs."""
    old, new, _, subs = _collapse(steps)
    first = next((i for i, s in enumerate(steps) if s.action == "strip"), len(steps))
    before = [(s.prefix, s.new) for s in steps[:first] if s.action == "sub"] if old else []
    after = [(s.prefix, s.new) for s in subs if (s.prefix, s.new) not in before]
    return [*before, *([(old, new)] if old else []), *after]


def _inner_pattern(prefix: str) -> str:
    return rf"\b{re.escape(prefix)}"


def _escape_equals(text: str) -> str:
    """``text`` as ``ckpt rename`` reads it before the ``=`` of ``--sub``/``--regex``."""
    return text.replace("=", "\\=")


def step_rules(steps: Sequence[Step]) -> tuple[KeyRule, ...]:
    """The rules that ``steps`` stand for, in the order ``ckpt rename`` applies them.

    ``ckpt rename`` applies its prefix maps (``--sub``) before its regex substitutions
    (``--regex``), whatever order they are given in: so the leading strips, merged into one
    map (with the adds, where there are strips), come first, then the steps' own prefix maps;
    an add with no strip to merge into is a regex and comes after them, then the inner strips.

    Args:
        steps: a fix's steps.

    Returns:
        The rules, for :func:`~ckpt_tools.structure.keys.plan_renames` or
        :func:`~ckpt_tools.structure.keys.rename_keys`.

    Raises:
        Nothing: any steps make rules.

    Example:
        >>> [r.description for r in step_rules([Step("sub", "a.", "b."), Step("add", "m.")])]
        ["'a.' -> 'b.'", 's/^/m./']
    """
    old, new, inner, _ = _collapse(steps)
    rules = [sub_rule(prefix, replacement) for prefix, replacement in _prefix_maps(steps)]
    rules += [regex_rule(p, r) for p, r in _regexes(old, new, inner)]
    return tuple(rules)


def _regexes(old: str, new: str, inner: Sequence[str]) -> list[tuple[str, str]]:
    """The substitutions after the prefix maps: an add with no strip to merge into (written
    literally: a backslash in a key is no escape), then the inner strips."""
    regexes = [("^", literal_replacement(new))] if new and not old else []
    return regexes + [(_inner_pattern(prefix), "") for prefix in inner]


def on_stored(aligned: Sequence[Step], steps: Sequence[Step]) -> tuple[Step, ...]:
    """``aligned``, then ``steps`` found on the aligned keys, as one rewrite of the stored keys.

    An alignment that only adds a prefix applies after every prefix map (to ``ckpt rename``
    it is a regex), so the maps that start with what it adds are taken back to before it.
    Whoever uses the result still checks it on the stored keys.

    Args:
        aligned: the alignment's steps.
        steps: steps found on the keys as the alignment left them.

    Returns:
        The steps to apply to the stored keys.

    Raises:
        Nothing: any steps combine.

    Example:
        >>> on_stored([Step("add", "m.")], [Step("sub", "m.a.", "m.b.")])
        (Step(action='add', prefix='m.', new=''), Step(action='sub', prefix='a.', new='b.'))
    """
    added = "".join(s.prefix for s in reversed(aligned) if s.action == "add")
    if not added or any(s.action == "strip" for s in aligned):
        return (*aligned, *steps)

    def before(step: Step) -> Step:
        prefix, new = step.prefix, step.new
        if step.action != "sub" or prefix == added:
            return step
        if prefix.startswith(added) and new.startswith(added):
            return Step("sub", prefix[len(added) :], new[len(added) :])
        return step

    return (*aligned, *(before(step) for step in steps))


def _out_path(path: str) -> str:
    """Where the suggested command writes: beside the input, named after it, a suffix that
    keeps its format (a sharded folder's safetensors or torch shards as one file).

    Example:
        >>> _out_path("ddp.pt"), _out_path("run/model.safetensors.index.json")
        ('ddp.renamed.pt', 'run/model.renamed.safetensors')
        >>> _out_path(".").startswith(os.path.abspath(".") + ".renamed.")  # not "..renamed"
        True
    """
    if path.endswith(".index.json"):  # model.safetensors.index.json names model.safetensors
        path = path.removesuffix(".index.json")
    elif path.endswith("/") or os.path.isdir(path):
        folder = path.rstrip("/")  # (a folder's name is no stem: llama-3.1-8b)
        if os.path.basename(folder) in ("", ".", ".."):  # named by where it is: its own name
            folder = os.path.abspath(path)
        try:
            safetensors = any(n.endswith(".safetensors") for n in os.listdir(folder))
        except OSError:
            safetensors = True
        return f"{folder}.renamed{'.safetensors' if safetensors else '.pt'}"
    stem, suffix = os.path.splitext(path)
    return f"{stem}.renamed{suffix}"


def _strips_every_wrapper(steps: Sequence[Step], keys: Sequence[str] | None) -> bool:
    """Whether plain ``ckpt strip-module`` (every wrapper found in ``keys``) does what
    ``steps`` do to those keys, key for key."""
    if keys is None or any(s.action not in ("strip", "strip-inner") for s in steps):
        return False
    if any(s.prefix in FILE_DEPENDENT_PREFIXES for s in steps):
        return False  # strip-module keeps them in some files: named, they are stripped
    found = [("strip-inner" if m.inner else "strip", m.prefix) for m in detect_wrappers(keys)]
    if found != [(s.action, s.prefix) for s in steps]:
        return False
    try:
        return plan_renames(keys, strip_wrapper_rules(keys)[0]) == plan_renames(
            keys, step_rules(steps)
        )
    except KeyCollisionError:
        return False


def fix_command(
    path: str,
    steps: Sequence[Step],
    select: str | Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    *,
    allow_globals: Sequence[str] = (),
    recovered: bool = False,
    fmt: str = "",
) -> str:
    """The ``ckpt`` command that applies ``steps`` to the checkpoint file at ``path``.

    It applies :func:`step_rules` of ``steps``: ``strip-module`` or ``add-module`` where that
    is all they do, else ``rename`` with its options in the order they apply.

    Args:
        path: the checkpoint to rewrite.
        steps: a fix's steps.
        select: the ``--select`` the state dict was chosen with, if any.
        keys: the file's keys; when the steps strip exactly the wrappers found in them, the
            command is plain ``ckpt strip-module IN OUT``.
        allow_globals: the file's globals outside the allowlist, each named to the rewrite
            (it refuses to carry them through otherwise).
        recovered: the state dict is a pickled module's: written to a ``.safetensors`` file,
            which holds its recovered state dict (a ``.pt`` rewrite would carry the module),
            leaving out the entries that are not tensors.
        fmt: the checkpoint's format: a DCP folder is consolidated first (``--strip`` where
            that is the whole fix); a TorchScript archive, which no rewrite writes, gets none.

    Returns:
        One shell command line (arguments quoted), writing ``<stem>.renamed<suffix>``; ``""``
        for a TorchScript archive.

    Raises:
        Nothing: any steps make a command.

    Example:
        >>> fix_command("ddp.pt", [Step("strip", "module.")], keys=["module.w"])
        'ckpt strip-module ddp.pt ddp.renamed.pt'
    """
    if fmt == "torchscript":  # its code names the attributes it holds
        return ""
    old, new, inner, subs = _collapse(steps)
    path = not_an_option(path)
    out = _out_path(path)
    if recovered:
        out = os.path.splitext(out)[0] + ".safetensors"
    first: list[str] = []
    if fmt == "dcp":  # rewrites read files: the folder is consolidated into one first
        first = ["ckpt", "consolidate", path, f"{path.rstrip('/')}.consolidated.pt"]
        first += ["--select", select_text(select)] if select is not None else []
        path, select = first[3], None
    args: list[str]
    if _strips_every_wrapper(steps, keys):
        args = ["ckpt", "strip-module", path, out]
    elif subs or inner or (old and new):
        # Listed in the order they apply: every --sub, then every --regex.
        maps = _prefix_maps(steps)
        args = ["ckpt", "rename", path, out]
        # OLD and PATTERN end at the first "=" not written "\=" (a key may hold one).
        args += [a for o, n in maps for a in ("--sub", f"{_escape_equals(o)}={n}")]
        regexes = _regexes(old, new, inner)
        args += [a for p, r in regexes for a in ("--regex", f"{_escape_equals(p)}={r}")]
    elif new:
        args = ["ckpt", "add-module", path, out]
        args += ["--prefix", new] if new != "module." else []
    else:
        args = ["ckpt", "strip-module", path, out, "--prefix", old]
    if select is not None:
        args += ["--select", select_text(select)]
    args += [a for g in allow_globals for a in ("--allow-global", g)]
    args += ["--drop-extras"] if recovered else []
    if first and args[1:2] == ["strip-module"] and len(args) == 4:
        args = [*first[:3], out, "--strip", *first[4:]]  # consolidate strips them itself
    elif first:
        return f"{_quoted(first)} && {_quoted(args)}"
    return _quoted(args)


def _quoted(args: Sequence[str]) -> str:
    return " ".join(shell_word(a) for a in args)


def fix_python(steps: Sequence[Step], name: str = "sd") -> str:
    """The Python call that applies ``steps`` (their :func:`step_rules`) to an in-memory
    state dict called ``name``.

    Args:
        steps: a fix's steps.
        name: what the state dict is called in the printed call.

    Returns:
        One expression, calling the public functions of ``ckpt_tools``.

    Raises:
        Nothing: any steps make a call.

    Example:
        >>> fix_python([Step("add", "module.")])
        "ckpt_tools.add_prefix(sd, prefix='module.')"
    """
    old, new, inner, subs = _collapse(steps)
    if not subs and not inner and not (old and new):
        if new:
            return f"ckpt_tools.add_prefix({name}, prefix={new!r})"
        return f"ckpt_tools.strip_prefix({name}, prefix={old!r})"
    rules = [f"ckpt_tools.sub_rule({old!r}, {new!r})"] if old else []
    rules += [f"ckpt_tools.sub_rule({s.prefix!r}, {s.new!r})" for s in subs]
    rules += [f"ckpt_tools.regex_rule({p!r}, {r!r})" for p, r in _regexes(old, new, inner)]
    return f"ckpt_tools.rename_keys({name}, [{', '.join(rules)}])"
