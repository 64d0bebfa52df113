"""``python -m ckpt_tools``: the ``ckpt`` command."""

from ckpt_tools.cli.main import run

run()
