"""Checking a written output before it is named: the verification levels and what each reads
back.

torch-free, like all of :mod:`ckpt_tools.io`: an output is re-opened with our own readers
and compared with what the plan said it would hold; a mismatch means it is not kept.
"""
