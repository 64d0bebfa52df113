"""``ckpt strip-module``, ``add-module``, ``rename``, ``convert``, ``retag``, ``reshard``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from ckpt_tools._escape import shell_word
from ckpt_tools.cli.options import (
    allow_global_option,
    drop_extras_option,
    dry_run_option,
    durable_option,
    jobs_option,
    json_option,
    max_shard_size_option,
    option_group,
    output_format_option,
    select_option,
    verify_option,
)
from ckpt_tools.cli.writing import quiet_option, run_and_show
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.ops.rewrite.conversion import convert, retag
from ckpt_tools.ops.rewrite.rewriting import add_module, rename, strip_module
from ckpt_tools.structure.keys import KeyRule, regex_rule, sub_rule


def _rewrite(
    call: Callable[..., Any], src: str, dst: str, kw: dict[str, Any], **extra: Any
) -> None:
    """``call(src, dst, **extra)`` with the options every rewrite takes, then its result shown."""
    options = ("select", "force", "in_place", "verify", "allow_globals", "dry_run", "durable")
    run_and_show(
        call,
        src,
        dst,
        as_json=kw["as_json"],
        quiet=kw["quiet"],
        **{name: kw[name] for name in options},
        **extra,
    )


#: Options every rewrite takes.
_common = option_group(
    click.argument("src", type=click.Path()),
    click.argument("dst", type=click.Path()),
    select_option,
    click.option(
        "--force",
        is_flag=True,
        help="Replace DST if it exists (never the input); a folder DST keeps all but its "
        "weight files (model*.safetensors, pytorch_model*.bin and their index).",
    ),
    click.option(
        "--in-place",
        is_flag=True,
        help="Allow DST to be SRC (still written to a temp file, then renamed).",
    ),
    verify_option("After writing, re-read the output: keys and sizes, or also every byte."),
    durable_option,
    allow_global_option,
    quiet_option,
    json_option,
    dry_run_option,
)


@click.command("strip-module")
@_common
@drop_extras_option
@click.option(
    "--prefix",
    default=None,
    help="Strip exactly this prefix (default: every wrapper found: module., _orig_mod., ...).",
)
def strip_module_cmd(src: str, dst: str, prefix: str | None, drop_extras: bool, **kw: Any) -> None:
    """Strip wrapper prefixes (DataParallel/DDP 'module.', torch.compile '_orig_mod.', ...)."""
    _rewrite(strip_module, src, dst, kw, prefix=prefix, drop_extras=drop_extras)


@click.command("add-module")
@_common
@drop_extras_option
@click.option("--prefix", default="module.", show_default=True, help="The prefix to add.")
def add_module_cmd(src: str, dst: str, prefix: str, drop_extras: bool, **kw: Any) -> None:
    """Add a wrapper prefix to every key (to load into nn.DataParallel / DDP)."""
    _rewrite(add_module, src, dst, kw, prefix=prefix, drop_extras=drop_extras)


# An OLD=NEW that fits each option: a key prefix for --sub, a device tag for --map.
_PAIR_EXAMPLES = {"--sub": "backbone.=encoder.", "--map": "cuda:1=cpu"}


def _pairs(values: tuple[str, ...], option: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        # OLD ends at the first bare "=": a key prefix may hold one, written "\=" as in a
        # --regex pattern (a device tag holds none).
        old, new = _split_regex(value) or ("", "")
        if not old:
            raise UsageError(
                f"{option} {value!r}: expected OLD=NEW, e.g. {option} {_PAIR_EXAMPLES[option]}"
            )
        pairs.append((old, new))
    return pairs


def _bare_equals(value: str) -> list[int]:
    """Where ``value`` has an ``=`` no backslash escapes (``\\\\=``: a backslash, then one)."""
    found, i = [], 0
    while i < len(value):
        if value[i] == "\\":
            i += 2  # an escape pair: its second character is never a bare '='
            continue
        if value[i] == "=":
            found.append(i)
        i += 1
    return found


def _split_regex(value: str) -> tuple[str, str] | None:
    """``PATTERN=REPL`` split at the first bare ``=``; ``\\=`` in PATTERN is ``=``.

    ``=`` is special in a regex only right after ``(?``, ``(?<`` or ``(?P``, where ``\\=`` is
    no valid regex: reading ``\\=`` as ``=`` changes the meaning of no pattern, and lets
    lookbehinds and ``(?P=name)`` be written. REPL is taken as it is, ``=`` included.
    """
    bare = _bare_equals(value)
    if not bare:
        return None
    # Every '=' before the first bare one is escaped: the backslash just before it goes.
    return value[: bare[0]].replace("\\=", "="), value[bare[0] + 1 :]


def _escaped_but_last(value: str) -> str:
    """``value`` with every bare ``=`` but the last written ``\\=``: the fix to suggest."""
    out, start = [], 0
    for i in _bare_equals(value)[:-1]:
        out += [value[start:i], "\\="]
        start = i + 1
    return "".join(out) + value[start:]


def _regex_rules(values: tuple[str, ...]) -> list[KeyRule]:
    """The ``--regex`` values as rules; a pattern cut short by an ``=`` it holds says how."""
    rules = []
    for value in values:
        split = _split_regex(value)
        if split is None or not split[0]:
            raise UsageError(
                f"--regex {value!r}: expected PATTERN=REPLACEMENT, e.g. --regex "
                f"'blocks\\.(\\d+)=layers.\\1' (an '=' inside PATTERN is written '\\=')"
            )
        try:
            rules.append(regex_rule(*split))
        except UsageError as e:
            fixed = _escaped_but_last(value)
            if e.argument != "pattern" or fixed == value or _split_regex(fixed) is None:
                raise
            why = "the pattern ends at the first '=' not written '\\='"
            fix = Remedy(flag=f"--regex {shell_word(fixed)}", text=f"({why})")
            raise UsageError(
                e.message, argument=e.argument, value=e.value, flag=e.flag, remedies=(fix,)
            ) from e
    return rules


class _RulesInOrder(click.Command):
    """``rename``: click gathers each repeated option apart; the order ``--sub`` and
    ``--regex`` were given in is kept (``ctx.meta``), since each rule applies to the keys the
    ones before it made."""

    def make_parser(self, ctx: click.Context) -> Any:
        parser = super().make_parser(ctx)
        parse = parser.parse_args

        def parse_args(args: list[str]) -> Any:
            opts, rest, order = parse(args=args)
            ctx.meta[_RULE_ORDER] = [p.name for p in order if p.name in ("subs", "regexes")]
            return opts, rest, order

        parser.parse_args = parse_args
        return parser


_RULE_ORDER = "ckpt_tools.rename.rule_order"


@click.command("rename", cls=_RulesInOrder)
@_common
@drop_extras_option
@click.option(
    "--sub",
    "subs",
    multiple=True,
    metavar="OLD=NEW",
    help="Prefix map (repeatable). OLD ends at the first '=': write an '=' inside it as '\\='.",
)
@click.option(
    "--regex",
    "regexes",
    multiple=True,
    metavar="PATTERN=REPL",
    help="Regex substitution (repeatable), as re.sub makes it. PATTERN ends at the first '=': "
    "write an '=' inside it as '\\=', e.g. --regex '(?<\\=\\.)gamma=weight'.",
)
def rename_cmd(
    src: str,
    dst: str,
    subs: tuple[str, ...],
    regexes: tuple[str, ...],
    drop_extras: bool,
    **kw: Any,
) -> None:
    """Rename keys: prefix maps (--sub) and regex substitutions (--regex), in the order given."""
    made = {
        "subs": iter([sub_rule(old, new) for old, new in _pairs(subs, "--sub")]),
        "regexes": iter(_regex_rules(regexes)),
    }
    order = click.get_current_context().meta.get(_RULE_ORDER, ["subs"] * len(subs))
    rules = [next(made[name]) for name in order]
    rules += [*made["subs"], *made["regexes"]]  # (none left where the order was read)
    _rewrite(rename, src, dst, kw, rules=rules, drop_extras=drop_extras)


@click.command("convert")
@_common
@output_format_option("DST")
@drop_extras_option
@max_shard_size_option(
    "Write DST as a Hugging Face folder with shards up to SIZE (default 5GB when DST ends "
    "with / or is a folder)."
)
@jobs_option
def convert_cmd(
    src: str,
    dst: str,
    output_format: str | None,
    drop_extras: bool,
    max_shard_size: str | None,
    jobs: int,
    **kw: Any,
) -> None:
    """Convert between torch (.pt), safetensors and Hugging Face sharded folders.

    SRC may be a sharded folder; DST a folder (ending with '/') for sharded output.
    Legacy inputs come out as zip archives.
    """
    _rewrite(
        convert,
        src,
        dst,
        kw,
        output_format=output_format,
        drop_extras=drop_extras,
        max_shard_size=max_shard_size,
        jobs=jobs,
    )


@click.command("reshard")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@max_shard_size_option("Largest shard.", required=True)
@drop_extras_option
@allow_global_option
@click.option(
    "--force",
    is_flag=True,
    help="Write into a non-empty DST folder: replace its weight files (model*.safetensors, "
    "pytorch_model*.bin and their index), keep everything else.",
)
@verify_option("After writing, re-read every shard: keys and sizes, or also every byte.")
@durable_option
@jobs_option
@quiet_option
@json_option
@dry_run_option
def reshard_cmd(src: str, dst: str, max_shard_size: str, **kw: Any) -> None:
    """Rewrite a Hugging Face sharded folder with another shard size (SRC is never touched)."""
    from ckpt_tools.ops.transform.reshard import reshard

    run_and_show(reshard, src, dst, max_shard_size=max_shard_size, **kw)


@click.command("retag")
@_common
@click.option(
    "--map",
    "maps",
    multiple=True,
    required=True,
    metavar="OLD=NEW",
    help="Saved device tag mapping, e.g. --map cuda:1=cpu (repeatable).",
)
def retag_cmd(src: str, dst: str, maps: tuple[str, ...], **kw: Any) -> None:
    """Rewrite saved device tags (cuda:1 -> cpu) so plain torch.load works anywhere."""
    mapping: dict[str, str] = {}
    for old, new in _pairs(maps, "--map"):
        if mapping.setdefault(old, new) != new:  # (the last would win, without a word)
            raise UsageError(f"--map maps {old} twice, to {mapping[old]} and to {new}; give one")
    _rewrite(retag, src, dst, kw, mapping=mapping)
