"""The ``ckpt`` console script: answers ``--version`` and the common key rewrites click-free.

A user's first commands (``--version``, then a rewrite) should not wait for click to load:
``--version`` is answered here, ``strip-module``/``add-module`` with plain options run
through :mod:`ckpt_tools.cli.fastpath`, and every other invocation goes to
:func:`ckpt_tools.cli.main.run`.
"""

from __future__ import annotations

import sys

# The commands the fast path may take; it decides on their arguments.
_FAST = ("strip-module", "add-module")


def run() -> None:
    """Console-script entry: ``--version`` at once, plain key rewrites without click."""
    argv = sys.argv[1:]
    if argv == ["--version"]:
        from ckpt_tools._version import __version__

        # The line click's version_option prints (tests/cli/test_entry.py compares them).
        sys.stdout.write(f"ckpt, version {__version__}\n")
        sys.exit(0)
    if argv and argv[0] in _FAST:
        import gc

        # A key rewrite lives well under a second and makes little cyclic garbage (its
        # memory is the checkpoint's metadata, alive to the end). The collector's passes
        # over what the imports created, during the run and once more at exit, cost about
        # 10 ms of the ~70 ms a rewrite adds to its copy (issue 13; benchmarks/README.md).
        gc.disable()
        from ckpt_tools.cli.fastpath import run as run_fast

        code = run_fast(argv)
        if code is not None:
            gc.freeze()  # the exit frees everything without scanning it for cycles first
            sys.exit(code)
        gc.enable()  # click's way: the commands that run long (training) need the collector
    from ckpt_tools.cli.main import run as run_click

    run_click()
