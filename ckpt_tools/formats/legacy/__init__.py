"""torch's formats before the zip archive: the legacy pickle stream (1.5 and older), the tar
format, and a plain pickle.

torch-free, like all of :mod:`ckpt_tools.formats`: each file is opened into the same
:class:`~ckpt_tools.formats.base.Checkpoint` a zip archive gives, and read only as far as
``torch.load`` would read it.
"""
