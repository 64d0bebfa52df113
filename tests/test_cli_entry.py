"""The console script's entry: ``ckpt --version`` answers before click loads (issue 13)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from ckpt_tools.cli.main import cli
from tests.helpers import console_script, run_ckpt


def test_the_fast_version_is_the_line_click_prints() -> None:
    clicks = CliRunner().invoke(cli, ["--version"], prog_name="ckpt")
    assert clicks.exit_code == 0
    fast = subprocess.run(
        [console_script(), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert fast.stdout == clicks.output
    assert fast.stderr == ""


def test_the_version_loads_neither_click_nor_the_readers() -> None:
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('click', 'ckpt_tools', 'torch'))))\n"
        "sys.argv = ['ckpt', '--version']\n"
        "from ckpt_tools.cli.entry import run\n"
        "run()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0].startswith("ckpt, version ")
    assert out[1] == str(
        ["ckpt_tools", "ckpt_tools._version", "ckpt_tools.cli", "ckpt_tools.cli.entry"]
    )


@pytest.mark.parametrize(
    "argv", [["--version", "inspect"], ["inspect", "--version"], ["--version", "--version"]]
)
def test_anything_else_goes_through_click(argv: list[str]) -> None:
    # Not the lone flag: the process answers as click does in-process, whatever that is.
    assert run_ckpt(*argv, code=None, how="module") == run_ckpt(*argv, code=None)
