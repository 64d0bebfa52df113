"""File -> file operations and ``inspect``/``scan``: each builds a plan and hands it to
``io.writers``.
"""
