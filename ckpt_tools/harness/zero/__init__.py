"""DeepSpeed ZeRO in the harness: the ``zero`` training strategy (:mod:`.strategy`), and the
tests' real ZeRO runs (:mod:`.runs`) with what starts them under torchrun (:mod:`.launch`)."""
