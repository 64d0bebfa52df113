"""The ``ckpt_tools`` logger, which the library's notes and warnings go to.

It has a :class:`logging.NullHandler`, as a library's logger should: a program that
configures no logging hears nothing from us (Python's last-resort handler would print our
warnings to its stderr). Configure the ``ckpt_tools`` logger to see them; the ``ckpt``
command prints its warnings to stderr.
"""

from __future__ import annotations

import logging

__all__ = ["logger"]

logger = logging.getLogger("ckpt_tools")
logger.addHandler(logging.NullHandler())
