"""``inspect``: what a checkpoint holds, read from its structure, and what to do with it."""
