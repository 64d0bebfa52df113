"""Pickles, never executed: the restricted unpickler, its allowlist and limits, stand-ins, the
re-pickler, and the import walk the scanner uses.

torch-free: a pickle is read into descriptors and stand-ins, and every global and opcode it
uses is checked as ``torch.load(weights_only=True)`` checks them.
"""
