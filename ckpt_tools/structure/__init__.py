"""What keys and nesting mean, torch-free: selection, the tensors in a tree, key rules,
wrapper prefixes, module grouping, and the suggested fix for a mismatch.

Pure functions over state dicts of descriptors; nothing here reads or writes a file.
"""
