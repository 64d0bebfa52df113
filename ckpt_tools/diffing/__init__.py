"""diffing"""
