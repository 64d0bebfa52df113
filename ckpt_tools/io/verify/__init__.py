"""Checking a written output before it is named: the verification levels and what each reads
back.
"""
