"""The ``ckpt`` commands: each parses its options, calls one library function, renders the
result.
"""
