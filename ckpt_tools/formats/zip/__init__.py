"""Zip archives as torch reads them: the central directory, record lookup and the torch zip
reader.
"""
