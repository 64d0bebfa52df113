"""``consolidate``: a sharded DCP folder into one file or a Hugging Face folder, in bounded
memory.
"""
