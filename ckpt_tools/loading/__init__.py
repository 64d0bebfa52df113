"""The torch side: ``load_state_dict`` and ``load_into`` on our own reader, devices and
``map_location``.

The lowest room that may import torch. Files are opened torch-free by
:mod:`ckpt_tools.formats` and only the tensors are built with torch, so a load calls nothing a
pickle names unless the caller passes ``trust=True`` (``torch.load(weights_only=False)``).
"""
