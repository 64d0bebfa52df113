"""The examples that end every command's ``--help``: each one runs, so none can rot."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from ckpt_tools.cli.examples import EXAMPLES, Example, epilog
from ckpt_tools.cli.main import cli
from tests.helpers import run_ckpt


def command_paths() -> list[str]:
    """Every command by its path under ``ckpt`` (``""`` is ``ckpt`` itself, then
    ``"inspect"`` ... ``"harness parity"``), each loaded as ``ckpt`` loads it."""

    def walk(command: click.Command, path: str) -> Iterator[str]:
        yield path
        if isinstance(command, click.Group):
            context = click.Context(command)
            for name in command.list_commands(context):
                sub = command.get_command(context, name)
                assert sub is not None, name
                yield from walk(sub, f"{path} {name}".strip())

    return list(walk(cli, ""))


PATHS = command_paths()
CASES = [
    pytest.param(path, example, id=f"{path or 'ckpt'}-{i}")
    for path, examples in EXAMPLES.items()
    for i, example in enumerate(examples)
]


def test_every_command_has_examples_and_every_example_a_command() -> None:
    assert sorted(EXAMPLES) == sorted(PATHS)
    for path, examples in EXAMPLES.items():
        assert 2 <= len(examples) <= 3, path
        for example in examples:
            words = shlex.split(example.line, comments=True)
            assert words[: 1 + len(path.split())] == ["ckpt", *path.split()], example


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p or "ckpt")
def test_every_help_ends_with_its_examples_as_written(path: str) -> None:
    help_text = run_ckpt(*path.split(), "--help").stdout
    tail = help_text.rstrip("\n").split("\n\n")[-1]
    # click's \b kept the lines as written (indented by 2): not rewrapped into a paragraph.
    expected = epilog(path)
    assert expected is not None
    assert tail.splitlines() == ["  " + line for line in expected.splitlines()[1:]]
    for example in EXAMPLES[path]:
        assert f"  {example.line}" in help_text


@pytest.mark.parametrize(("path", "example"), CASES)
def test_every_example_runs(path: str, example: Example, examples_folder: Path) -> None:
    args = shlex.split(example.line, comments=True)
    assert args[0] == "ckpt" and "|" not in args and ">" not in args
    run_ckpt(*args[1:], code=example.code)
