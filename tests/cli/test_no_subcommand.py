"""A group called without its command shows its help, as click does, not an error line."""

from __future__ import annotations

import pytest

from ckpt_tools.cli.main import main
from ckpt_tools.harness.__main__ import main as harness_main


@pytest.mark.parametrize(
    ("argv", "usage"),
    [([], "Usage: ckpt [OPTIONS] COMMAND"), (["harness"], "Usage: ckpt harness [OPTIONS] COMMAND")],
)
def test_a_bare_group_prints_its_help_to_stderr_and_exits_2(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2  # click's own exit for a group without its command
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(usage)
    assert "error:" not in captured.err and "\nCommands:\n" in captured.err


def test_the_harness_process_entry_alone_prints_its_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert harness_main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: python -m ckpt_tools.harness [OPTIONS] COMMAND")
    assert "  parity " in err and "  train " in err
