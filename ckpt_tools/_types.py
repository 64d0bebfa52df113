"""The types the public signatures share: one name, one type, one meaning per option.

Every operation that takes one of these options spells it the same way and gives it the same
default (``tests/structure/test_public_api.py`` checks every name in ``ckpt_tools.__all__``):

- ``select: Select = None``: the state dict to act on, a dotted path (``"model.ema"``) or its
  parts (``("model", "ema")``); None picks it as ``ckpt inspect`` does.
- ``verify: VerifyLevel = "sizes"``: what is read back after writing.
- ``output_format: OutputFormat | None = None``: None takes it from ``dst``'s suffix (else the
  input's family); a format that contradicts the suffix is refused.
- ``progress: Progress | None = None``: told ``(done_bytes, total_bytes)`` as tensor bytes are
  written.
- ``map_location: MapLocation = "auto"``: where loaded storages go.

Nothing here imports torch: :data:`MapLocation` names ``torch.device`` as a forward reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

__all__ = ["MapLocation", "OutputFormat", "Progress", "Select", "StrPath", "VerifyLevel"]

#: A path as ``open`` takes it: a string or an ``os.PathLike`` (``pathlib.Path``).
StrPath = str | os.PathLike[str]

#: A state dict's place in a checkpoint: ``"model.ema"``, ``("model", "ema")``, or None for the
#: automatic choice.
Select = str | Sequence[str] | None

#: After writing: ``"sizes"`` reads the output back (keys, dtypes, shapes, sizes), ``"full"`` also
#: compares every byte, ``"none"`` reads nothing back.
VerifyLevel = Literal["none", "sizes", "full"]

#: What to write: a torch zip (``torch.save``'s format) or a safetensors file.
OutputFormat = Literal["torch", "safetensors"]

#: ``progress(done_bytes, total_bytes)``: tensor bytes written so far, of the output's total.
Progress = Callable[[int, int], None]

#: Where loaded storages go: every form ``torch.load`` takes (a device string, a
#: ``torch.device``, a dict of saved tag -> tag, a callable ``(storage, tag) -> storage | None``,
#: None for the saved devices), plus ``"auto"``. ``torch.device`` is named, not imported: this
#: module stays torch-free.
MapLocation = Union[str, "torch.device", Mapping[str, str], Callable[[Any, str], Any], None]  # noqa: F821
