"""The console script's entry: one click parser, each command's module loaded on use."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ckpt_tools.cli.examples import epilog
from ckpt_tools.cli.main import _COMMANDS, cli
from tests.helpers import console_script, fixture_path, run_ckpt


def test_the_console_script_s_version_is_the_line_click_prints() -> None:
    clicks = CliRunner().invoke(cli, ["--version"], prog_name="ckpt")
    assert clicks.exit_code == 0
    script = subprocess.run(
        [console_script(), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert script.stdout == clicks.output
    assert script.stdout.startswith("ckpt, version ")
    assert script.stderr == ""


def test_the_version_loads_click_and_the_group_only() -> None:
    # No command module, no reader, not even the error tree: `ckpt --version` is a
    # user's first command, and its start-up is measured in benchmarks/bench_startup.py.
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ckpt_tools', 'torch', 'numpy', 'tabulate'))))\n"
        "sys.argv = ['ckpt', '--version']\n"
        "from ckpt_tools.cli.main import run\n"
        "run()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0].startswith("ckpt, version ")
    assert out[1] == str(
        [
            "ckpt_tools",
            "ckpt_tools._version",
            "ckpt_tools.cli",
            "ckpt_tools.cli.boundary",
            "ckpt_tools.cli.main",
        ]
    )


@pytest.mark.parametrize(
    "argv", [["--version", "inspect"], ["inspect", "--version"], ["--version", "--version"]]
)
def test_anything_else_goes_through_click(argv: list[str]) -> None:
    # Not the lone flag: the process answers as click does in-process, whatever that is.
    assert run_ckpt(*argv, code=None, how="module") == run_ckpt(*argv, code=None)


def _command(name: str) -> click.Command:
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, name
    return command


@pytest.mark.parametrize("name", sorted(_COMMANDS))
def test_the_help_listing_summary_is_the_command_s_own(name: str) -> None:
    # `ckpt --help` lists the table's summaries without importing the commands: each must be
    # its command's first help paragraph, shortened by click as the command itself would be.
    command = _command(name)
    summary = _COMMANDS[name].summary
    assert command.short_help is None and not command.hidden and not command.deprecated
    assert (command.help or "").split("\n\n")[0] == summary
    stand_in = click.Command(name, help=summary)
    for limit in (20, 45, 62, 100, 200):
        assert stand_in.get_short_help_str(limit) == command.get_short_help_str(limit)


def test_every_command_is_in_the_listing_once() -> None:
    listed = CliRunner().invoke(cli, ["--help"], prog_name="ckpt", terminal_width=200).output
    # The rows end where the examples start, after a blank line.
    rows = listed.split("Commands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [row.split()[0] for row in rows] == list(_COMMANDS)
    for row in rows:
        name = row.split()[0]
        assert row.split(None, 1)[1] == _command(name).get_short_help_str(200 - 6 - 12)


@pytest.mark.parametrize("width", [40, 80, 120])
def test_the_help_listing_matches_click_s_own(width: int) -> None:
    # The oracle: click's own Group listing over the imported commands.
    eager = click.Group(
        "ckpt",
        commands={name: _command(name) for name in _COMMANDS},
        help=cli.help,
        epilog=epilog(""),
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    eager.params = cli.params
    ours = CliRunner().invoke(cli, ["--help"], prog_name="ckpt", terminal_width=width)
    theirs = CliRunner().invoke(eager, ["--help"], prog_name="ckpt", terminal_width=width)
    assert ours.exit_code == theirs.exit_code == 0
    # click's Group keeps its commands sorted; ours keeps the table's order (a user's path).
    assert sorted(ours.output.splitlines()) == sorted(theirs.output.splitlines())


def test_the_help_imports_no_command() -> None:
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('ckpt_tools', 'torch', 'numpy') and ('_cmd' in m or '.' not in m or "
        "m.startswith(('ckpt_tools.ops', 'ckpt_tools.formats'))))))\n"
        "sys.argv = ['ckpt', '--help']\n"
        "from ckpt_tools.cli.main import run\n"
        "run()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    assert "Commands:" in out
    assert out[-1] == str(["ckpt_tools"])


_FIRST_READ = """
import os, sys
src = os.path.abspath(sys.argv[1])
seen = []

def hook(event, args):
    # The first time the process opens the input: which modules were loaded by then.
    opened = event == "open" and isinstance(args[0], str) and os.path.abspath(args[0]) == src
    if opened and not seen:
        seen.append(sorted(m for m in sys.modules if m.startswith("ckpt_tools.")))

sys.addaudithook(hook)
sys.argv = ["ckpt", *sys.argv[3:], sys.argv[1], sys.argv[2]]
from ckpt_tools.cli.main import run
try:
    run()
finally:
    print(seen[0] if seen else None)
"""

# The write side of a rewrite: none of it is needed to start reading the input.
_WRITE_SIDE = (
    "ckpt_tools.io.copy.clone",
    "ckpt_tools.io.copy.direct",
    "ckpt_tools.io.writers.safetensors",
    "ckpt_tools.io.verify.outputs",
    "ckpt_tools.io.writers.torchzip",
    "ckpt_tools.io.writers.zipfile",
    "ckpt_tools.ops.rewrite.apply",
)


@pytest.mark.parametrize(
    ("command", "source", "output"),
    [
        (["strip-module"], "dataparallel.pt", "out.pt"),
        (["strip-module", "--prefix", "module."], "dataparallel.pt", "out.pt"),
        (["add-module"], "plain.pt", "out.safetensors"),
        (["retag", "--map", "cpu=cuda:1"], "plain.pt", "out.pt"),
    ],
)
def test_a_rewrite_reads_its_input_before_loading_the_write_side(
    command: list[str], source: str, output: str, tmp_path
) -> None:
    # The first read comes before half of a rewrite's imports (its time is measured by
    # benchmarks/bench_rewrite.py, never in a test).
    out = tmp_path / output
    run = subprocess.run(
        [sys.executable, "-c", _FIRST_READ, str(fixture_path(source)), str(out), *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    loaded = ast.literal_eval(run.stdout.splitlines()[-1])
    assert loaded, "the input was never opened"
    assert "ckpt_tools.formats" in loaded and "ckpt_tools.ops.rewrite.rewriting" in loaded
    assert not set(_WRITE_SIDE) & set(loaded)
    assert out.is_file()  # and the rewrite then loads them and writes, as before


_LOADED_AT_EXIT = """
import atexit, sys
atexit.register(
    lambda: print(sorted(m for m in sys.modules if m.startswith("ckpt_tools.") or m == "hashlib"))
)
sys.argv = ["ckpt", "strip-module", *sys.argv[1:]]
from ckpt_tools.cli.main import run
run()
"""

# What a rewrite of one format loads that the other format's rewrite must not.
_ZIP_SIDE = {
    "ckpt_tools.formats.pickle.unpickler",
    "ckpt_tools.formats.pickle.repickle",
    "ckpt_tools.formats.zip.directory",
    "ckpt_tools.io.writers.torchzip",
    "ckpt_tools.io.verify.zipcheck",
}


@pytest.mark.parametrize(
    ("source", "output", "absent"),
    [
        ("model.safetensors", "out.safetensors", _ZIP_SIDE),
        ("dataparallel.pt", "out.pt", {"ckpt_tools.io.writers.safetensors"}),
    ],
)
def test_a_rewrite_loads_the_reader_and_writer_of_its_formats_only(
    source: str, output: str, absent: set[str], tmp_path
) -> None:
    # A .safetensors rewrite never needs the pickle machinery, a .pt rewrite never the
    # safetensors writer; each costs milliseconds of every start.
    src = tmp_path / ("wrapped" + Path(source).suffix)
    if source.endswith(".safetensors"):
        from safetensors.torch import load_file, save_file

        save_file({f"module.{k}": v for k, v in load_file(fixture_path(source)).items()}, src)
    else:
        src.write_bytes(fixture_path(source).read_bytes())
    run = subprocess.run(
        [sys.executable, "-c", _LOADED_AT_EXIT, str(src), str(tmp_path / output)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "stripped 'module.'" in run.stdout
    loaded = set(ast.literal_eval(run.stdout.splitlines()[-1]))
    assert "ckpt_tools.io.verify.outputs" in loaded  # it did write and verify
    assert not absent & loaded
    assert "hashlib" not in loaded  # only --verify full and cut temp names need it
