"""Transforms that make new tensors (slim, extract, average, reshard) and the plans they share."""
