"""DeepSpeed ZeRO checkpoint folders: the tag folder and its rank files, what each holds, and
where every parameter's bytes lie in the ranks' flat fp32 partitions.

torch-free, like all of :mod:`ckpt_tools.formats`: each rank file is a torch zip archive read
by the restricted unpickler; DeepSpeed's classes (``ZeroStageEnum``, the loss scalers,
``fragment_address``) are read as inert stand-ins and never imported.
"""
