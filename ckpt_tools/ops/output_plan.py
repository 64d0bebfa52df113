"""What a dry run shows of the files a command would write: files, tensors, dtypes, sizes.

``consolidate``, ``sanitize``, ``reshard`` and ``convert IN OUT_DIR/`` plan their output
before writing a byte (which tensors go to which file, from their plan objects); with
``dry_run=True`` they stop there and put the plan, as :class:`PlannedFile` s, in their
result. The same text and JSON renderings serve every one of them, so the plans read alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools.structure.text import human_bytes

__all__ = ["PlannedFile", "PlannedTensor", "planned_text"]

# Tensors listed per file in the text; ``--json`` has them all.
_TENSORS_SHOWN = 40


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a planned output file.

    Attributes:
        key: its name in the output (a dotted path for nested torch files).
        dtype: torch dtype name (``float32``).
        shape: its shape.
        nbytes: bytes of its data.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class PlannedFile:
    """One file a command would write.

    Attributes:
        name: the file's path (for folder outputs: its name inside the folder).
        tensors: the tensors it would hold, in writing order (none for an index file).
        nbytes: tensor bytes it would hold; for an index, the index's exact size.
    """

    name: str
    tensors: tuple[PlannedTensor, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "nbytes": self.nbytes,
            "tensors": [t.to_json() for t in self.tensors],
        }

    @classmethod
    def of(cls, name: str, tensors: Iterable[PlannedTensor]) -> PlannedFile:
        """A data file: its bytes are its tensors' bytes.

        Example:
            >>> PlannedFile.of("m.safetensors", [PlannedTensor("w", "float32", (2,), 8)]).nbytes
            8
        """
        listed = tuple(tensors)
        return cls(name, listed, sum(t.nbytes for t in listed))


def planned_text(files: Sequence[PlannedFile], shown: int = _TENSORS_SHOWN) -> list[str]:
    """Lines listing every planned file and its first ``shown`` tensors.

    Example:
        >>> f = PlannedFile.of("m.pt", [PlannedTensor("fc.weight", "float32", (2, 3), 24)])
        >>> print("\\n".join(planned_text([f])))
          m.pt  24 B, 1 tensors
            fc.weight  float32  (2, 3)  24 B
    """
    lines = []
    for f in files:
        lines.append(f"  {f.name}  {human_bytes(f.nbytes)}, {len(f.tensors)} tensors")
        for t in f.tensors[:shown]:
            lines.append(f"    {t.key}  {t.dtype}  {tuple(t.shape)}  {human_bytes(t.nbytes)}")
        if len(f.tensors) > shown:
            lines.append(f"    ... {len(f.tensors) - shown} more")
    return lines


def plan_json(files: Sequence[PlannedFile]) -> dict[str, Any]:
    """The JSON fields every planned write shares: the files and the total tensor bytes."""
    return {
        "planned_files": [f.to_json() for f in files],
        "planned_bytes": sum(f.nbytes for f in files if f.tensors),
    }
