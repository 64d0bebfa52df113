"""Differences between a checkpoint and a module or another checkpoint: keys, shapes, dtypes,
values, and the exact fix.

Values are compared with torch (this room may import it); files are read through
:mod:`ckpt_tools.loading`, never with ``torch.load``.
"""
