"""The ``ckpt`` console script: answers ``ckpt --version`` before importing anything.

A user's first commands (``--version``, then a rewrite) should not wait for click and the
readers to load; every other invocation goes to :func:`ckpt_tools.cli.main.run`.
"""

from __future__ import annotations

import sys


def run() -> None:
    """Console-script entry: ``--version`` at once, everything else through click."""
    if sys.argv[1:] == ["--version"]:
        from ckpt_tools._version import __version__

        # The line click's version_option prints (tests/test_cli_entry.py compares them).
        sys.stdout.write(f"ckpt, version {__version__}\n")
        sys.exit(0)
    from ckpt_tools.cli.main import run as run_click

    run_click()
