"""torch.distributed.checkpoint folders: the ``.metadata`` file, the globals it pickles, and the
item files.

torch-free, like all of :mod:`ckpt_tools.formats`: the metadata pickle is read by the
restricted unpickler, against the DCP classes it may name, and never executed.
"""
