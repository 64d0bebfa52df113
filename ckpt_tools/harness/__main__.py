"""``python -m ckpt_tools.harness train|parity ...``: the ``ckpt harness`` group as a process.

This is what ``torchrun`` starts, once per rank::

    torchrun --standalone --nproc-per-node 2 -m ckpt_tools.harness train \\
        --strategy ddp --arch mlp --steps 5 --out DIR

The only harness module that imports :mod:`ckpt_tools.cli`: it runs the same click group
as ``ckpt harness``, behind the same error boundary (message and exit code) as ``ckpt``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

from ckpt_tools.cli.commands.harness import harness
from ckpt_tools.cli.main import run_command

__all__ = ["main"]

PROG_NAME = "python -m ckpt_tools.harness"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the harness command line as ``python -m ckpt_tools.harness``.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` by default.

    Returns:
        The exit status: 0 ok, 1 parity failed, 2 usage error (any CheckpointError: its
        exit code).
    """
    return run_command(harness, argv, prog_name=PROG_NAME)


if __name__ == "__main__":
    status = main()
    # A rank ran gloo's (and DeepSpeed's) threads: the interpreter's own exit can abort on
    # them (std::terminate, even after destroy_process_group), and torchrun would report
    # SIGABRT instead of this status. Everything is written and closed by now.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None where it was closed before the start (>&-)
            with contextlib.suppress(OSError, ValueError):  # a pipe closed since
                stream.flush()
    os._exit(status)
