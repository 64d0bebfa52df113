"""One tensor as :func:`~.inspection.inspect` describes it: :class:`TensorInfo`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ckpt_tools.errors import shown
from ckpt_tools.structure.text import human_bytes

__all__ = ["TensorInfo", "group_sharing", "table_row"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the selected state dict.

    Attributes:
        name: its key.
        dtype: torch dtype name without ``torch.``.
        shape: sizes.
        stride: strides in elements.
        numel: element count.
        nbytes: bytes its elements take.
        device: saved device tag.
        storage: storage key; tensors with the same key share memory.
        offset: storage offset in elements.
        storage_nbytes: the whole storage's size.
        sharing: every key of the state dict viewing the same storage, this one included,
            in key order (one tuple, shared by all of them).
        is_parameter: saved as ``nn.Parameter``.
        layout: torch's layout name: ``strided`` for a dense tensor (a meta one too),
            ``sparse_coo``, ``sparse_csr`` ... or ``nested``. A tensor that is no view of one
            storage (sparse, meta, nested) has no storage or offset of its own (``""``, 0):
            its storage column names its parts' storages, its bytes are theirs, and a sparse
            or nested tensor has no strides.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    nbytes: int
    device: str
    storage: str
    offset: int
    storage_nbytes: int
    sharing: tuple[str, ...] = ()
    is_parameter: bool = False
    layout: str = "strided"

    @property
    def shared_with(self) -> tuple[str, ...]:
        """The other keys of the state dict viewing the same storage, in key order."""
        return tuple(n for n in self.sharing if n != self.name)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "layout": self.layout,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "numel": self.numel,
            "nbytes": self.nbytes,
            "device": self.device,
            "storage": self.storage,
            "offset": self.offset,
            "storage_nbytes": self.storage_nbytes,
            "shared_with": list(self.shared_with),
        }

    def __str__(self) -> str:
        """``layers.0.weight float32 [64, 32] cpu`` (``sparse_coo`` after the shape where so)."""
        layout = "" if self.layout == "strided" else f" {self.layout}"
        return shown(f"{self.name} {self.dtype} {list(self.shape)}{layout} {self.device}")


def group_sharing(members: Sequence[TensorInfo]) -> tuple[str, str]:
    """A folded row's storage and "shared with" cells: the one storage its members view (or
    nothing where they view several), and whether they share memory with each other and
    with which keys outside the group.

    Args:
        members: the tensors one row stands for.

    Returns:
        ``(storage, shared)``: ``("3", "each other, head.w")`` for tied members that a
        third key views too; ``("", "")`` for members that share nothing.

    Example:
        >>> tied = ("h.0.w", "h.1.w")
        >>> group_sharing([TensorInfo(n, "float32", (2,), (1,), 2, 8, "cpu", "0", 0, 8, tied)
        ...                for n in tied])
        ('0', 'each other')
    """
    names = {t.name for t in members}
    storages = {t.storage for t in members}
    inside = False
    outside: list[str] = []
    # Tensors viewing one storage hold one sharing tuple: each is read once, not per member.
    for sharing in {id(t.sharing): t.sharing for t in members}.values():
        inside = inside or sum(n in names for n in sharing) > 1
        if len(outside) < 3:
            outside += islice((n for n in sharing if n not in names), 3 - len(outside))
    shared = (["each other"] if inside else []) + outside[:2]
    text = ", ".join(shared) + (" ..." if len(outside) > 2 else "")
    return (storages.pop() if len(storages) == 1 else ""), text


def table_row(
    label: str, t: TensorInfo, members: Sequence[TensorInfo], folded: tuple[str, str] | None
) -> list[str]:
    """One row of ``inspect``'s tensor table: ``t``'s, or a folded group's (``members``,
    first ``t``; ``folded``: their :func:`group_sharing`). A folded row's storage and sharing
    are its members', its offset no one's, its bytes their sum (sparse and nested tensors of
    one shape differ). Only the first others are looked at, never every view of a storage."""
    count = len(members)
    if folded is None:
        others = list(islice((n for n in t.sharing if n != t.name), 3))
        folded = (t.storage, ", ".join(others[:2]) + (" ..." if len(others) > 2 else ""))
    return [
        label,
        t.dtype if t.layout == "strided" else f"{t.dtype} ({t.layout})",
        "[" + ", ".join(map(str, t.shape)) + "]",
        t.device,
        folded[0],
        str(t.offset) if count == 1 else "",
        human_bytes(sum(m.nbytes for m in members)),
        folded[1],
    ]
