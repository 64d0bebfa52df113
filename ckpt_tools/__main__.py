"""``python -m ckpt_tools``: the ``ckpt`` command."""

from ckpt_tools.cli.entry import run

run()
