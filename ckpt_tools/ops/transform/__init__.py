"""Transforms that make new tensors (slim, extract, reshard; average builds on them) and the
plans they share."""
