"""The fuzzer of hostile and odd inputs: seeds, structure-aware mutators, sandboxed workers,
invariants, oracle.

Nothing here imports ``ckpt_tools`` internals: the library is driven through ``python -m
ckpt_tools`` and the public ``import ckpt_tools as ct`` API only (inside a sandboxed worker).
"""
