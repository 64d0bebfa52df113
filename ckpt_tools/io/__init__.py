"""Bytes to and from storage, torch-free: atomic outputs, the copy engine, the writers,
verification, casts and tensor bytes.
"""
