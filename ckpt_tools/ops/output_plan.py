"""What every writing operation returns, and the one rendering of it for people and programs.

Every operation that writes a file (the rewrites, ``slim``, ``extract``, ``average``,
``convert`` to a folder, ``reshard``, ``consolidate``, ``sanitize``) returns a
:class:`WriteResult` subclass, with the same names for the same things. With
``dry_run=True`` it plans its output before writing a byte (which tensors go to which file)
and stops there: the plan is the result's ``planned`` files, rendered here for every
operation alike, so the plans read the same whatever wrote them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.io.writers.shard_plan import INDEX_NAME, ShardPlan, index_bytes
from ckpt_tools.structure.tensor_walk import iter_listed_tensors, iter_stored_tensors
from ckpt_tools.structure.text import Readable, human_bytes, shown

__all__ = [
    "PlannedFile",
    "PlannedTensor",
    "WriteResult",
    "plan_json",
    "planned_text",
]

# Tensors listed per file, and names left out, in the text; ``--json`` has them all.
_TENSORS_SHOWN = 40
_NAMES_SHOWN = 8


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

    @classmethod
    def of(cls, key: str, tensor: TensorRef | RebuiltTensor) -> PlannedTensor:
        """The planned row of ``tensor`` written under ``key`` (a sparse or nested one: the
        bytes of its parts)."""
        return cls(key, tensor.dtype, tuple(tensor.shape), tensor.nbytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class PlannedFile:
    """One file an operation would write.

    Attributes:
        name: the file's path (inside the output folder for folder outputs).
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
        """A data file whose bytes are its tensors' bytes (safetensors: one record each).

        Example:
            >>> PlannedFile.of("m.safetensors", [PlannedTensor("w", "float32", (2,), 8)]).nbytes
            8
        """
        listed = tuple(tensors)
        return cls(name, listed, sum(t.nbytes for t in listed))

    @classmethod
    def of_tree(cls, name: str, tree: Any, *, attributes: bool = False) -> PlannedFile:
        """A torch file holding ``tree``: every tensor listed (sparse, meta and nested ones
        too), each storage's bytes once (with ``attributes``, those of the tensors a tensor's
        attributes hold too).

        Example:
            >>> from ckpt_tools.descriptors import StorageRef
            >>> s = StorageRef("0", "float32", 4, "cpu")
            >>> w = TensorRef(storage=s, offset=0, shape=(4,), stride=(1,), dtype="float32")
            >>> tied = PlannedFile.of_tree("m.pt", {"w": w, "tied": w})
            >>> len(tied.tensors), tied.nbytes
            (2, 16)
        """
        stored = iter_stored_tensors(tree, attributes=attributes)
        storages = {id(t.storage): t.storage.nbytes for _, t in stored}
        listed = tuple(PlannedTensor.of(k, t) for k, t in iter_listed_tensors(tree))
        return cls(name, listed, sum(storages.values()))


def planned_text(files: Sequence[PlannedFile], limit: int = _TENSORS_SHOWN) -> list[str]:
    """Lines listing every planned file (its tensors and their bytes; an index file, its
    size) and its first ``limit`` tensors.

    Example:
        >>> f = PlannedFile.of("m.pt", [PlannedTensor("fc.weight", "float32", (2, 3), 24)])
        >>> print("\\n".join(planned_text([f])))
          m.pt  1 tensors, 24 B of tensor data
            fc.weight  float32  (2, 3)  24 B
    """
    lines = []
    for f in files:
        held = f"{len(f.tensors)} tensors, {human_bytes(f.nbytes)} of tensor data"
        lines.append(f"  {f.name}  {held if f.tensors else human_bytes(f.nbytes)}")
        for t in f.tensors[:limit]:
            lines.append(f"    {t.key}  {t.dtype}  {tuple(t.shape)}  {human_bytes(t.nbytes)}")
        if len(f.tensors) > limit:
            lines.append(f"    ... {len(f.tensors) - limit} more")
    return lines


def plan_json(files: Sequence[PlannedFile]) -> dict[str, Any]:
    """The JSON fields every planned write shares: the files and the total tensor bytes."""
    return {
        "planned_files": [f.to_json() for f in files],
        "planned_bytes": sum(f.nbytes for f in files if f.tensors),
    }


def planned_shard_files(
    dst: str,
    tensors: Mapping[str, TensorRef],
    plan: ShardPlan,
    metadata: Mapping[str, str] | None = None,
) -> tuple[PlannedFile, ...]:
    """The shards ``plan`` lays out in the folder ``dst``, their tensors (by name, from
    ``tensors``), and, for more than one shard, the index with its exact size.

    Example:
        >>> from ckpt_tools.io.writers.shard_plan import plan_shards
        >>> from ckpt_tools.descriptors import StorageRef
        >>> t = TensorRef(StorageRef("0", "float32", 4, "cpu"), 0, (4,), (1,), "float32")
        >>> shards = plan_shards([("a", 16), ("b", 16)], 16)
        >>> files = planned_shard_files("out", {"a": t, "b": t}, shards)
        >>> [os.path.basename(f.name) for f in files][1:]
        ['model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    """
    files = [
        PlannedFile.of(os.path.join(dst, file), (PlannedTensor.of(n, tensors[n]) for n in names))
        for file, names in plan.files
    ]
    if plan.is_sharded:
        index = len(index_bytes(plan, metadata))
        files.append(PlannedFile(os.path.join(dst, INDEX_NAME), (), index))
    return tuple(files)


def dry_run_fields(dst: str, planned: Iterable[PlannedFile]) -> dict[str, Any]:
    """The fields of a dry run's result: what it would write into ``dst``, and the weight
    files of an existing output folder there that the real write would remove.

    Args:
        dst: the output path as given.
        planned: every file the write would make.

    Returns:
        ``dry_run``, ``planned`` and ``removes``, as :class:`WriteResult` takes them.

    Example:
        >>> dry_run_fields("no-such-folder", [])
        {'dry_run': True, 'planned': (), 'removes': ()}
    """
    # Lazily: the writers are imported only by a dry run, or by the write itself.
    from ckpt_tools.io.writers.folder_swap import removed_files

    files = tuple(planned)
    removes = removed_files(dst, [f.name for f in files])
    return {"dry_run": True, "planned": files, "removes": removes}


@dataclass(frozen=True, kw_only=True, repr=False)
class WriteResult(Readable):
    """What a writing operation did, or with ``dry_run`` would do: the fields all share.

    Attributes:
        src: the input (the first of several, for ``average``).
        dst: the output path as given (a file, or a folder for sharded outputs).
        input_format: format of the input.
        output_format: ``torch-zip``, ``safetensors`` or ``hf-sharded``.
        written: the files written, in order (shards before their index); empty for a dry
            run, or when there was nothing to do.
        dry_run: nothing was written; ``planned`` says what would have been.
        bytes_written: tensor bytes the output holds (for a dry run, would hold).
        bytes_copied: of those, the bytes copied from an input as they are; the rest were
            computed (casts, means, numpy arrays' new records, chunks assembled or views
            gathered through a buffer).
        verification: what was verified after writing (empty for a dry run).
        message: one line for people.
        notes: what else was decided, in words.
        dropped: names left out of the output (tied duplicates, non-tensor entries, ...).
        planned: for a dry run, every file it would write and the tensors in it.
        removes: for a dry run into an existing folder (``force``), the weight files there
            that the write would remove: those it does not write anew. Every operation
            fills it in, with ``planned``, through :func:`dry_run_fields`.
        selected: the path of the state dict acted on, in the input (empty: the root, or
            everything, as ``consolidate(include_all=True)`` writes it).
        tensors: tensors the output holds (for a dry run, would hold).
        renamed: keys of the state dict the operation renamed (a rewrite's rules,
            ``strip``, ``strip_prefix``).
    """

    src: str
    dst: str
    input_format: str
    output_format: str
    written: tuple[str, ...] = ()
    dry_run: bool = False
    bytes_written: int = 0
    bytes_copied: int = 0
    verification: str = ""
    message: str = ""
    notes: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    planned: tuple[PlannedFile, ...] = ()
    selected: tuple[str, ...] = ()
    tensors: int = 0
    renamed: int = 0
    removes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        # Subclasses are declared with repr=False: this short form is everyone's.
        return (
            f"{type(self).__name__}(src={self.src!r}, dst={self.dst!r}, "
            f"output_format={self.output_format!r}, written={len(self.written)} file(s), "
            f"dry_run={self.dry_run})"
        )

    def details(self) -> list[str]:
        """Lines an operation adds under the message (renames, casts, conversions)."""
        return []

    def left_out(self) -> list[str]:
        """The lines naming what was left out."""
        if not self.dropped:
            return []
        more = " ..." if len(self.dropped) > _NAMES_SHOWN else ""
        return [f"left out: {', '.join(self.dropped[:_NAMES_SHOWN])}{more}"]

    def text(self) -> str:
        """The message, the operation's details, then the plan (dry run) or the totals.

        Example:
            >>> r = WriteResult(src="a.pt", dst="b.pt", input_format="torch-zip",
            ...     output_format="torch-zip", written=("b.pt",), bytes_written=2048,
            ...     bytes_copied=2048, verification="verified: keys and sizes",
            ...     message="wrote b.pt")
            >>> print(r)
            wrote b.pt
            torch-zip, 2.0 KiB of tensors written, 2.0 KiB of them copied; verified: keys and sizes
        """
        lines = [self.message, *self.details()]
        lines += [f"  note: {n}" for n in self.notes]
        lines += self.left_out()
        if self.dry_run:
            lines += planned_text(self.planned)
            lines += [f"  {path}  removed (a weight file already there)" for path in self.removes]
            lines.append("nothing written")
        elif self.written:
            if len(self.written) > 1:
                lines += [f"  {path}" for path in self.written]
            lines.append(
                f"{self.output_format}, {human_bytes(self.bytes_written)} of tensors written, "
                f"{human_bytes(self.bytes_copied)} of them copied; {self.verification}"
            )
        # Each line escaped whole: a name with a line break in it cannot start a line.
        return "\n".join(map(shown, lines))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data: the shared fields, then (for a dry run) the planned files."""
        return {
            "src": self.src,
            "dst": self.dst,
            "input_format": self.input_format,
            "output_format": self.output_format,
            "written": list(self.written),
            "dry_run": self.dry_run,
            "bytes_written": self.bytes_written,
            "bytes_copied": self.bytes_copied,
            "verification": self.verification,
            "message": self.message,
            "notes": list(self.notes),
            "dropped": list(self.dropped),
            "selected": list(self.selected),
            "tensors": self.tensors,
            "renamed": self.renamed,
            **(plan_json(self.planned) if self.dry_run else {}),
            **({"planned_removals": list(self.removes)} if self.dry_run else {}),
        }
