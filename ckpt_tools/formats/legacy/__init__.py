"""torch's formats before the zip archive: the legacy pickle stream (1.5 and older), the tar
format, and a plain pickle.
"""
