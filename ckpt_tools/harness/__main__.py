"""``python -m ckpt_tools.harness``: see :mod:`ckpt_tools.harness.cli`."""

from ckpt_tools.harness.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
