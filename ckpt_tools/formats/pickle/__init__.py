"""Pickles, never executed: the restricted unpickler, its allowlist and limits, stand-ins, the
re-pickler, and the import walk the scanner uses.
"""
