"""Differences between a checkpoint and a module or another checkpoint: keys, shapes, dtypes,
values, and the exact fix.
"""
