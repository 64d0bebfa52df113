"""``ckpt strip-module``, ``add-module``, ``rename``, ``convert``, ``retag``, ``reshard``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from ckpt_tools.cli.options import (
    allow_global_option,
    dry_run_option,
    durable_option,
    json_option,
    select_option,
    verify_option,
)
from ckpt_tools.cli.render import echo_result
from ckpt_tools.errors import UsageError
from ckpt_tools.ops.rewrite.conversion import convert, retag
from ckpt_tools.ops.rewrite.rewriting import add_module, rename, strip_module
from ckpt_tools.structure.keys import regex_rule, sub_rule

# The progress bar is drawn only for rewrites worth watching.
_BAR_BYTES = 64 << 20

#: ``--quiet``/``-q`` of every writing command: goes with :func:`progress_bar` and
#: ``echo_result(quiet=)``.
quiet_option = click.option(
    "--quiet", "-q", is_flag=True, help="Print nothing on success: no progress bar, no summary."
)


@contextlib.contextmanager
def progress_bar(quiet: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback that draws a bar on a terminal (stderr), or None.

    Args:
        quiet: the command's ``--quiet``: no bar.

    Yields:
        ``progress(done, total)`` for the library call, or None when no bar is wanted
        (quiet, stderr not a terminal); the bar appears once ``total`` reaches 64 MiB.
    """
    if quiet or not sys.stderr.isatty():
        yield None
        return
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if total < _BAR_BYTES:
            return
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = click.progressbar(
                length=total, label="copying tensors", file=sys.stderr, show_pos=False
            )
            bar.__enter__()
            state["done"] = 0
        bar.update(done - state["done"])
        state["done"] = done

    try:
        yield update
    finally:
        if "bar" in state:
            state["bar"].__exit__(None, None, None)


def library_options(
    kw: dict[str, Any], progress: Callable[[int, int], None] | None
) -> dict[str, Any]:
    """The library's keyword arguments for the options every rewrite command takes."""
    return {
        "select": kw["select"],
        "force": kw["force"],
        "in_place": kw["in_place"],
        "verify": kw["verify"],
        "allow_globals": kw["allow_globals"],
        "progress": progress,
        "dry_run": kw["dry_run"],
        "durable": kw["durable"],
    }


def _common(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options every rewrite takes."""
    options = [
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
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.command("strip-module")
@_common
@click.option(
    "--prefix",
    default=None,
    help="Strip exactly this prefix (default: every wrapper found: module., _orig_mod., ...).",
)
def strip_module_cmd(src: str, dst: str, prefix: str | None, **kw: Any) -> None:
    """Strip wrapper prefixes (DataParallel/DDP 'module.', torch.compile '_orig_mod.', ...)."""
    with progress_bar(kw["quiet"]) as progress:
        result = strip_module(src, dst, prefix=prefix, **library_options(kw, progress))
    echo_result(result, kw["as_json"], kw["quiet"])


@click.command("add-module")
@_common
@click.option("--prefix", default="module.", show_default=True, help="The prefix to add.")
def add_module_cmd(src: str, dst: str, prefix: str, **kw: Any) -> None:
    """Add a wrapper prefix to every key (to load into nn.DataParallel / DDP)."""
    with progress_bar(kw["quiet"]) as progress:
        result = add_module(src, dst, prefix=prefix, **library_options(kw, progress))
    echo_result(result, kw["as_json"], kw["quiet"])


def _pairs(values: tuple[str, ...], option: str) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        old, sep, new = value.partition("=")
        if not sep or not old:
            raise UsageError(
                f"{option} {value!r}: expected OLD=NEW, e.g. {option} backbone.=encoder."
            )
        pairs.append((old, new))
    return pairs


@click.command("rename")
@_common
@click.option("--sub", "subs", multiple=True, metavar="OLD=NEW", help="Prefix map (repeatable).")
@click.option(
    "--regex",
    "regexes",
    multiple=True,
    metavar="PATTERN=REPL",
    help="Regex substitution (repeatable).",
)
def rename_cmd(
    src: str, dst: str, subs: tuple[str, ...], regexes: tuple[str, ...], **kw: Any
) -> None:
    """Rename keys: prefix maps (--sub) then regex substitutions (--regex)."""
    with progress_bar(kw["quiet"]) as progress:
        rules = [sub_rule(old, new) for old, new in _pairs(subs, "--sub")]
        rules += [regex_rule(p, r) for p, r in _pairs(regexes, "--regex")]
        result = rename(src, dst, rules=rules, **library_options(kw, progress))
    echo_result(result, kw["as_json"], kw["quiet"])


@click.command("convert")
@_common
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["torch", "safetensors"]),
    default=None,
    help="Output format (default: from DST's suffix).",
)
@click.option("--drop-extras", is_flag=True, help="Leave out non-tensor entries (safetensors).")
@click.option(
    "--max-shard-size",
    default=None,
    metavar="SIZE",
    help="Write a Hugging Face sharded folder with shards up to SIZE (5GB = 5*10^9, 2GiB); "
    "implied (5GB) when DST ends with '/' or is a folder.",
)
def convert_cmd(
    src: str, dst: str, fmt: str | None, drop_extras: bool, max_shard_size: str | None, **kw: Any
) -> None:
    """Convert between torch (.pt), safetensors and Hugging Face sharded folders.

    SRC may be a sharded folder; DST a folder (ending with '/') for sharded output.
    Legacy inputs come out as zip archives.
    """
    with progress_bar(kw["quiet"]) as progress:
        result = convert(
            src,
            dst,
            output_format=fmt,
            drop_extras=drop_extras,
            max_shard_size=max_shard_size,
            **library_options(kw, progress),
        )
    echo_result(result, kw["as_json"], kw["quiet"])


@click.command("reshard")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option(
    "--max-shard-size",
    required=True,
    metavar="SIZE",
    help="Largest shard: 5GB (5*10^9 bytes, as huggingface_hub), 2GiB, or bytes.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Write into a non-empty DST folder: replace its weight files (model*.safetensors, "
    "pytorch_model*.bin and their index), keep everything else.",
)
@verify_option("After writing, re-read every shard: keys and sizes, or also every byte.")
@durable_option
@click.option(
    "--jobs", type=int, default=1, show_default=True, help="Shards written at once (threads)."
)
@quiet_option
@json_option
@dry_run_option
def reshard_cmd(src: str, dst: str, max_shard_size: str, **kw: Any) -> None:
    """Rewrite a Hugging Face sharded folder with another shard size (SRC is never touched)."""
    from ckpt_tools.ops.transform.reshard import reshard

    with progress_bar(kw["quiet"]) as progress:
        result = reshard(
            src,
            dst,
            max_shard_size=max_shard_size,
            force=kw["force"],
            verify=kw["verify"],
            progress=progress,
            jobs=kw["jobs"],
            dry_run=kw["dry_run"],
            durable=kw["durable"],
        )
    echo_result(result, kw["as_json"], kw["quiet"])


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
    with progress_bar(kw["quiet"]) as progress:
        mapping = dict(_pairs(maps, "--map"))
        result = retag(src, dst, mapping=mapping, **library_options(kw, progress))
    echo_result(result, kw["as_json"], kw["quiet"])
