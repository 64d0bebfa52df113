"""The ``ckpt`` command: a thin adapter that parses, calls one library function, renders."""
