"""Moving bytes from a source into an output: reflinks, kernel copies, direct writes, and the
layout that keeps records where they were.
"""
