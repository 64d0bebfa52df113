"""The ``ckpt`` console script (``setup.cfg``) and ``python -m ckpt_tools``: click's group.

Every command line goes through the one click parser in :mod:`ckpt_tools.cli.main`, which
imports a command's module only when that command runs.
"""

from __future__ import annotations

from ckpt_tools.cli.main import run

__all__ = ["run"]
