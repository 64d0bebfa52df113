"""``python -m ckpt_tools.harness train|parity ...``: the ``ckpt harness`` group as a process.

This is what ``torchrun`` starts, once per rank::

    torchrun --standalone --nproc-per-node 2 -m ckpt_tools.harness train \\
        --strategy ddp --arch mlp --steps 5 --out DIR

The only harness module that imports :mod:`ckpt_tools.cli`: it runs the same click group
as ``ckpt harness``, behind the same error boundary (message and exit code) as ``ckpt``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_tools.cli.commands.harness import harness
from ckpt_tools.cli.main import leave, run_command

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
    leave(main())  # everything is written and closed by now (see leave_at_exit)
