"""``--quiet``: nothing on success, for every command that has it; errors still say why."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import click
import pytest

from ckpt_tools.cli.examples import EXAMPLES
from ckpt_tools.cli.main import cli
from tests.helpers import run_ckpt


def quiet_commands() -> list[str]:
    """The commands with a ``--quiet`` option."""
    found = []
    context = click.Context(cli)
    for name in cli.list_commands(context):
        command = cli.get_command(context, name)
        assert command is not None
        if any(param.name == "quiet" for param in command.params):
            found.append(name)
    return found


QUIET = quiet_commands()


def first_write(name: str) -> list[str]:
    """The command's first help example that writes, as arguments after ``ckpt``."""
    for example in EXAMPLES[name]:
        args = shlex.split(example.line, comments=True)[1:]
        if example.code == 0 and not {"--dry-run", "--json"} & set(args):
            return args
    raise AssertionError(f"{name} has no example that writes")


def test_the_rewrites_have_quiet() -> None:
    rewrites = {"strip-module", "add-module", "rename", "convert", "retag", "reshard"}
    assert rewrites <= set(QUIET)


def test_the_other_writing_commands_have_quiet() -> None:
    assert {"consolidate", "sanitize", "slim", "extract", "average", "merge-lora"} <= set(QUIET)


@pytest.mark.parametrize("name", QUIET)
def test_quiet_prints_nothing_on_success(name: str, examples_folder: Path) -> None:
    args = first_write(name)
    assert run_ckpt(*args, "--quiet") == (0, "", "")
    # The same command without it says what it wrote (so the silence above is --quiet's).
    loud = run_ckpt(*args, "--force")
    assert loud.stdout.strip() and loud.stderr == ""


def test_quiet_errors_still_print_their_one_line(tmp_path: Path) -> None:
    missing, out = tmp_path / "missing.pt", tmp_path / "out.pt"
    code, stdout, stderr = run_ckpt("strip-module", missing, out, "--quiet", code=None)
    assert code != 0 and stdout == ""
    assert len(stderr.splitlines()) == 1 and stderr.startswith("ckpt: error: ")
    assert "missing.pt" in stderr and not out.exists()


def test_quiet_keeps_what_was_asked_for_by_name(examples_folder: Path) -> None:
    data = json.loads(run_ckpt("strip-module", "ddp.pt", "q.pt", "-q", "--json").stdout)
    assert data["dst"] == "q.pt"
    plan = run_ckpt("convert", "model.pt", "q.safetensors", "-q", "--dry-run").stdout
    assert "q.safetensors" in plan and not (examples_folder / "q.safetensors").exists()
