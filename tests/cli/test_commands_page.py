"""docs/commands.md names every option of every command, and no option that is gone.

The options are the commands' own (click's parameters, as ``ckpt COMMAND --help`` lists
them); ``ckpt harness`` has its own page, docs/harness.md.
"""

from __future__ import annotations

import re

import click

from ckpt_tools.cli.main import cli
from tests.helpers import ROOT

PAGE = ROOT / "docs" / "commands.md"
OWN_PAGE = {"harness"}


def _options() -> dict[str, set[str]]:
    """Each command's long option names, ``--no-...`` forms included."""
    context = click.Context(cli)
    found: dict[str, set[str]] = {}
    for name in cli.list_commands(context):
        command = cli.get_command(context, name)
        assert command is not None
        found[name] = {
            opt
            for param in command.get_params(context)  # --help included
            if isinstance(param, click.Option)
            for opt in [*param.opts, *param.secondary_opts]
            if opt.startswith("--")
        }
    return found


def test_every_option_of_every_command_is_on_the_page() -> None:
    words = set(re.findall(r"--[a-z][a-z0-9-]*", PAGE.read_text(encoding="utf-8")))
    missing = {
        name: sorted(options - words)
        for name, options in _options().items()
        if name not in OWN_PAGE and options - words
    }
    assert missing == {}, "options missing from docs/commands.md"


def test_the_page_names_no_option_that_is_gone() -> None:
    words = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", PAGE.read_text(encoding="utf-8")))
    known = set().union(*_options().values())
    assert sorted(words - known) == []
