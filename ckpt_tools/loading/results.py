"""What :func:`ckpt_tools.loading.state_dict.load_state_dict` reports: where storages went, and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LoadInfo", "StorageMove"]


@dataclass(frozen=True)
class StorageMove:
    """Where the storages saved under one device tag were loaded.

    Attributes:
        saved: the saved tag (``cuda:1``).
        target: the device they were loaded on (``cpu``).
        storages: how many storages.
        nbytes: their total size.
    """

    saved: str
    target: str
    storages: int
    nbytes: int

    @property
    def moved(self) -> bool:
        return self.saved != self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "saved": self.saved,
            "target": self.target,
            "storages": self.storages,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class LoadInfo:
    """How :func:`load_state_dict` loaded a checkpoint.

    Attributes:
        path: the file or folder.
        format: see :data:`ckpt_tools.formats.FORMATS`.
        selected: keys leading to the state dict (``()`` for the root).
        selection_reason: why it was chosen.
        map_location: the ``map_location`` as given, in words (``auto``, ``cpu``, ...).
        placements: one entry per saved device tag: where its storages went.
        mmap: the file was memory-mapped (zip files loaded to the CPU, no copy).
        trusted: loaded with ``trust=True`` (full unpickling).
        tensors: tensors in the returned state dict.
    """

    path: str
    format: str
    selected: tuple[str, ...]
    selection_reason: str
    map_location: str
    placements: tuple[StorageMove, ...]
    mmap: bool
    trusted: bool
    tensors: int

    @property
    def moved(self) -> tuple[StorageMove, ...]:
        """The placements whose device differs from the saved one."""
        return tuple(p for p in self.placements if p.moved)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "selected": list(self.selected),
            "selection_reason": self.selection_reason,
            "map_location": self.map_location,
            "placements": [p.to_json() for p in self.placements],
            "mmap": self.mmap,
            "trusted": self.trusted,
            "tensors": self.tensors,
        }
