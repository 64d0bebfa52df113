"""What loading reports, torch-free: :class:`LoadInfo` (``load_state_dict``: where storages
went, and how) and :class:`LoadReport` (``load_into``: which keys matched, what was rewritten).

``str()`` of each is its text for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tools.errors import shown
from ckpt_tools.structure.grouping import fold_keys
from ckpt_tools.structure.text import Readable, human_bytes

__all__ = ["LoadInfo", "LoadReport", "ShapeMismatch", "StorageMove"]


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

    def __str__(self) -> str:
        """``cuda:1 -> cpu: 3 storages, 1.5 KiB`` (``cpu: ... (kept)`` when not moved)."""
        where = f"{self.saved} -> {self.target}" if self.moved else self.saved
        return f"{where}: {self.storages} storages, {human_bytes(self.nbytes)}" + (
            "" if self.moved else " (kept)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "saved": self.saved,
            "target": self.target,
            "storages": self.storages,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class LoadInfo(Readable):
    """How :func:`load_state_dict` loaded a checkpoint.

    Attributes:
        path: the file or folder.
        format: see :data:`ckpt_tools.formats.FORMATS`.
        selected: keys leading to the state dict (``()`` for the root).
        selection_reason: why it was chosen.
        map_location: the ``map_location`` as given, in words (``auto``, ``cpu``, ...).
        placements: one entry per saved device tag: where its storages went.
        mmap: storages came from the memory-mapped file (torch zip and safetensors records:
            no copy; a GPU target copies from the mapped pages).
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

    def moves(self) -> str:
        """The devices that changed on one line (``cuda:1 -> cpu, cuda:0 -> cpu``)."""
        return ", ".join(f"{m.saved} -> {m.target}" for m in self.moved)

    def text(self) -> str:
        """How the file was loaded, for people: source, selection, storages by device.

        Example:
            >>> from ckpt_tools import load_with_info
            >>> print(load_with_info("ddp.pt", mmap=True)[1])
            loaded 17 tensors from ddp.pt (torch-zip, memory-mapped)
            state dict: <root> (the root is a state dict)
            map_location: auto
              cpu: 17 storages, 2.2 KiB (kept)
        """
        how = [self.format]
        how += ["memory-mapped"] if self.mmap else []
        how += ["trusted: fully unpickled"] if self.trusted else []
        lines = [
            f"loaded {self.tensors} tensors from {self.path} ({', '.join(how)})",
            f"state dict: {'.'.join(self.selected) or '<root>'} ({self.selection_reason})",
            f"map_location: {self.map_location}",
        ]
        # Line by line: a path or device tag read from the file cannot start a line of its own.
        return "\n".join(map(shown, lines + [f"  {p}" for p in self.placements]))

    def __repr__(self) -> str:
        return (
            f"LoadInfo(path={self.path!r}, format={self.format!r}, tensors={self.tensors}, "
            f"moved={self.moves()!r})"
        )

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


@dataclass(frozen=True)
class ShapeMismatch:
    """A key whose tensor shape differs between checkpoint and model.

    Attributes:
        key: the key (after the wrapper rewrites).
        checkpoint_shape: the checkpoint tensor's shape.
        model_shape: the model tensor's shape.
    """

    key: str
    checkpoint_shape: tuple[int, ...]
    model_shape: tuple[int, ...]

    def __str__(self) -> str:
        """``head.weight checkpoint [2, 8] vs model [3, 8]``."""
        return (
            f"{self.key} checkpoint {list(self.checkpoint_shape)} vs model {list(self.model_shape)}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "checkpoint": list(self.checkpoint_shape),
            "model": list(self.model_shape),
        }


@dataclass(frozen=True)
class LoadReport(Readable):
    """What :func:`ckpt_tools.load_into` did.

    Attributes:
        source: the checkpoint path, or ``<state dict>``.
        model_class: the model's class name.
        model_layout: wrapper prefixes of the model's keys, outermost first.
        checkpoint_layout: wrapper prefixes of the checkpoint's keys, outermost first.
        rewrites: the key rewrites applied to the checkpoint (``stripping 'module.'``).
        loaded: keys copied into the model.
        missing: model keys the checkpoint lacks (after the rewrites), as torch reports them
            after the modules' own loading code.
        unexpected: checkpoint keys the model lacks (after the rewrites).
        shape_mismatches: keys present in both with different shapes (skipped).
        dtype_casts: ``(key, checkpoint dtype, model dtype)`` copied with a cast.
        info: how the file was loaded; None for an in-memory state dict.
        assigned: the loaded tensors became the model's (``load_state_dict(assign=True)``,
            as for a model built on the ``meta`` device): nothing was copied or cast.
        left_on_meta: parameters and buffers still on ``meta`` after an assign, which no
            state dict holds (non-persistent buffers, such as rotary ``inv_freq``): the model
            cannot run until they are made.
        meta_values: those of ``left_on_meta`` the checkpoint itself holds as meta tensors
            (saved from a model not yet made, or loaded with ``map_location="meta"``).
    """

    source: str
    model_class: str
    model_layout: tuple[str, ...]
    checkpoint_layout: tuple[str, ...]
    rewrites: tuple[str, ...]
    loaded: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shape_mismatches: tuple[ShapeMismatch, ...] = ()
    dtype_casts: tuple[tuple[str, str, str], ...] = ()
    info: LoadInfo | None = None
    assigned: bool = False
    left_on_meta: tuple[str, ...] = ()
    meta_values: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every key matched in name and shape."""
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def text(self) -> str:
        """What was loaded, rewritten, missing, unexpected, skipped and cast, for people."""
        how = f" ({', '.join(self.rewrites)})" if self.rewrites else ""
        lines = [f"loaded {self.loaded} keys from {self.source} into {self.model_class}{how}"]
        if self.missing:
            lines.append(f"missing ({len(self.missing)}): {fold_keys(self.missing)}")
        if self.unexpected:
            lines.append(f"unexpected ({len(self.unexpected)}): {fold_keys(self.unexpected)}")
        lines += [f"shape mismatch, skipped: {m}" for m in self.shape_mismatches]
        if self.dtype_casts:
            lines.append(f"cast to the model's dtype: {len(self.dtype_casts)} keys")
        if self.assigned:
            lines.append("assigned: the model's tensors are the loaded ones (no copy)")
        if self.left_on_meta:
            lines.append(
                f"still on meta ({len(self.left_on_meta)}): {self._why_on_meta()}; make them "
                "before running"
            )
        if self.info is not None and self.info.moved:
            lines.append(f"devices: {self.info.moves()}")
        return "\n".join(map(shown, lines))  # (a key cannot start a line of its own)

    def _why_on_meta(self) -> str:
        """The tensors left on meta, grouped by why no value reached them."""
        skipped = {m.key for m in self.shape_mismatches}
        groups: dict[str, list[str]] = {}
        for name in self.left_on_meta:
            if name in skipped:
                why = "shape mismatch, skipped"
            elif name in self.missing:
                why = "missing from the checkpoint"
            elif name in self.meta_values:
                why = "the checkpoint holds {} on meta, without values"
            else:
                why = "no state dict holds {}: {}non-persistent buffer{}"
            groups.setdefault(why, []).append(name)
        said = []
        for why, names in groups.items():
            one = len(names) == 1
            why = why.format("it" if one else "them", "a " if one else "", "" if one else "s")
            said.append(f"{fold_keys(names)} ({why})")
        return "; ".join(said)

    def __repr__(self) -> str:
        return (
            f"LoadReport(source={self.source!r}, model_class={self.model_class!r}, "
            f"loaded={self.loaded}, ok={self.ok}, rewrites={self.rewrites!r})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "model": self.model_class,
            "model_layout": list(self.model_layout),
            "checkpoint_layout": list(self.checkpoint_layout),
            "rewrites": list(self.rewrites),
            "loaded": self.loaded,
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "shape_mismatches": [m.to_json() for m in self.shape_mismatches],
            "dtype_casts": [list(c) for c in self.dtype_casts],
            "info": self.info.to_json() if self.info else None,
            "assigned": self.assigned,
            "left_on_meta": list(self.left_on_meta),
            "meta_values": list(self.meta_values),
        }
