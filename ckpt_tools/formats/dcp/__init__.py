"""torch.distributed.checkpoint folders: the ``.metadata`` file, the globals it pickles, and the
item files.
"""
