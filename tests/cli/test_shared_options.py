"""An option several commands take is declared alike in each: same flags, type, default, metavar.

Only the help text (what the option does in that command), ``required``, and the set of
choices (``--verify``'s levels) may differ; and the few options below, whose meaning is the
command's own.
"""

from __future__ import annotations

import click
import pytest

from ckpt_tools.cli.main import _COMMANDS, cli
from tests import helpers as h


def _options() -> dict[str, list[tuple[str, click.Option]]]:
    """Every option's name -> ``(command, option)`` for each command declaring it."""
    found: dict[str, list[tuple[str, click.Option]]] = {}
    for name in _COMMANDS:
        command = cli.get_command(click.Context(cli), name)
        assert command is not None
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                found.setdefault(param.name, []).append((name, param))
    return found


def _declaration(option: click.Option) -> tuple[object, ...]:
    kind = type(option.type).__name__
    bounds = (getattr(option.type, "min", None), getattr(option.type, "max", None))
    return (
        tuple(option.opts),
        tuple(option.secondary_opts),
        kind,
        bounds,
        option.default,
        option.metavar,
        option.is_flag,
        option.multiple,
    )


#: Options named alike whose meaning belongs to each command, and why.
OWN_MEANING = {
    "prefix": "the prefix strip-module strips (default: every wrapper), add-module adds "
    "(default module.) and extract takes",
    "fail_on": "scan exits 1 on a severity, diff on kinds of difference",
}
#: Commands whose option of that name means something else: scan's --format is how its
#: verdicts print (text, json, sarif), not the format of a file it writes.
OTHER_MEANING = {("output_format", "scan")}

SHARED = sorted(
    name for name, places in _options().items() if len(places) > 1 and name not in OWN_MEANING
)


def test_the_options_shared_by_several_commands_include_the_write_options() -> None:
    for name in ("max_shard_size", "jobs", "dtype", "verify", "durable", "force", "dry_run"):
        assert name in SHARED


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_option_is_declared_alike_everywhere(name: str) -> None:
    places = _options()[name]
    declarations = {}
    for command, option in places:
        if (name, command) in OTHER_MEANING:
            continue
        declarations.setdefault(_declaration(option), []).append(command)
    assert len(declarations) == 1, f"--{name} is declared {len(declarations)} ways: {declarations}"


@pytest.mark.parametrize("command", ["convert", "consolidate", "reshard"])
def test_every_sharding_command_takes_jobs_and_binary_sizes(command: str) -> None:
    text = h.run_ckpt(command, "--help").stdout
    assert "-j, --jobs" in text and "--max-shard-size SIZE" in text and "2GiB" in text


@pytest.mark.parametrize("command", ["convert", "consolidate", "reshard"])
def test_jobs_below_one_is_refused_by_the_parser(command: str, tmp_path) -> None:
    out = h.run_ckpt(
        command, tmp_path / "in", tmp_path / "out/", "--max-shard-size", "1GB", "-j", "0", code=2
    )
    assert "0 is not in the range x>=1" in out.stderr


def test_merge_lora_takes_every_dtype_spelling_slim_takes(tmp_path) -> None:
    out = h.run_ckpt(
        "merge-lora",
        tmp_path / "b.pt",
        tmp_path / "a",
        tmp_path / "o.pt",
        "--dtype",
        "int8",
        code=2,
    )
    assert "--dtype 'int8': expected one of: bf16, bfloat16, fp16, float16, half" in out.stderr
