"""The plan every transform (slim, extract, average) builds, and its execution.

A :class:`TransformPlan` holds the output's object tree and one
:class:`~ckpt_tools.io.writers.records.Record` per output storage: copied from a source span,
or streamed by a producer (a cast, a mean). :func:`execute_plan` hands it to the writer layer
(:func:`~ckpt_tools.io.writers.output.write_file`: temp file, records, verification, fsync,
rename); ``dry_run`` callers return the plan in their result instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import ConversionError, Remedy
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.atomic import AtomicFile
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers.output import write_file
from ckpt_tools.io.writers.plan import write_plan_zip
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import Record, check_records
from ckpt_tools.io.writers.safetensors import write_safetensors
from ckpt_tools.structure.paths import key_text
from ckpt_tools.structure.tensor_walk import iter_stored_tensors

__all__ = [
    "DROPPED",
    "Item",
    "PlanRow",
    "TransformPlan",
    "check_computable",
    "execute_plan",
    "sizes_after",
]


class _Dropped:
    """The output key of an item left out: a marker of its own, as ``None`` is a key too."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DROPPED"


DROPPED: Any = _Dropped()
# (source key, output key or DROPPED, value): what a transform writes, key by key.
Item = tuple[Any, Any, Any]

_OPTIMIZER_ENTRIES = ("optimizer", "optimizer_states", "optimizer_state_dict", "optim", "opt")


@dataclass(frozen=True)
class PlanRow:
    """One output tensor (or a dropped one): its key before and after, dtypes, sizes, action."""

    source_key: str
    key: str | None
    dtype_before: str
    dtype_after: str | None
    nbytes_before: int
    nbytes_after: int
    action: str

    @classmethod
    def of(
        cls,
        source_key: Any,
        key: Any,
        dtype_before: str,
        dtype_after: str | None,
        nbytes_before: int,
        nbytes_after: int,
        action: str,
    ) -> PlanRow:
        """The row of keys of any type, named as text (``None``, ``7``, ``(1, 2)`` are keys
        too); a ``drop`` row has no output key."""
        return cls(
            key_text(source_key),
            None if action == "drop" else key_text(key),
            dtype_before,
            dtype_after,
            nbytes_before,
            nbytes_after,
            action,
        )

    @property
    def dropped(self) -> bool:
        """Whether the tensor is left out of the output."""
        return self.action == "drop"

    def to_json(self) -> dict[str, Any]:
        return {
            "source_key": self.source_key,
            "key": self.key,
            "dtype_before": self.dtype_before,
            "dtype_after": self.dtype_after,
            "nbytes_before": self.nbytes_before,
            "nbytes_after": self.nbytes_after,
            "action": self.action,
        }


@dataclass(frozen=True)
class TransformPlan:
    """What a transform will write, before a byte is written.

    Attributes:
        command: ``slim``, ``extract`` or ``average``.
        sources: the input files.
        dst: the output path.
        output_format: ``torch-zip`` or ``safetensors``.
        tree: the torch output's object tree (None for safetensors).
        records: ``id(output storage)`` -> its record (torch outputs).
        entries: ``(name, tensor, record)`` for safetensors outputs.
        metadata: safetensors ``__metadata__``.
        expected: the output state dict's tensors (sparse, meta and nested ones too), for
            verification.
        select_out: the path of the state dict in the output.
        rows: one row per tensor of the state dict acted on.
        dropped_entries: top-level entries left out.
        size_before: bytes per category (weights, optimizer, other) in the input.
        size_after: bytes per category in the output (records; the pickle not counted).
        notes: what else was decided (which EMA copy, storages kept uncast ...).
        selected: the path of the state dict acted on, in the (first) input.
    """

    command: str
    sources: tuple[str, ...]
    dst: str
    output_format: str
    tree: Any
    records: Mapping[int, Record]
    entries: tuple[tuple[str, TensorRef, Record], ...]
    metadata: Mapping[str, str] | None
    expected: Mapping[str, TensorRef | RebuiltTensor]
    select_out: tuple[str, ...]
    rows: tuple[PlanRow, ...]
    dropped_entries: tuple[str, ...] = ()
    size_before: Mapping[str, int] = field(default_factory=dict)
    size_after: Mapping[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    selected: tuple[str, ...] = ()

    @property
    def output_bytes(self) -> int:
        """Tensor bytes the output will hold."""
        if self.output_format == "safetensors":
            return sum(r.nbytes for _, _, r in self.entries)
        return sum(r.nbytes for r in self.records.values())


def check_computable(name: str, tensor: TensorRef, doing: str, *, cast: bool) -> None:
    """Refuse to compute from ``tensor``'s bytes (a cast, a mean) when they are not its values.

    A conjugate or negative view is saved as its storage's bytes plus a bit torch applies on
    loading; computing from the bytes would drop the bit, whatever the output's format.

    Args:
        name: the tensor's output key, for the message.
        tensor: its descriptor as read.
        doing: what would compute from the bytes (``a cast to bfloat16``, ``a mean``).
        cast: the computation is a cast, which the tensor can be left out of.

    Raises:
        ConversionError: the tensor carries a view bit (exit 7).

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> s = StorageRef("0", "float32", 1, "cpu")
        >>> check_computable("w", TensorRef(s, 0, (1,), (1,), "float32"), "a mean", cast=False)
    """
    bits = sorted(tensor.view_bits)
    if not bits:
        return
    what = " and ".join({"conj": "conjugate", "neg": "negative"}[b] for b in bits)
    resolve = ".".join(f"resolve_{b}()" for b in bits)
    keep = (Remedy(text=f"keep {name!r} in its dtype"),) if cast else ()
    raise ConversionError(
        f"tensor {name!r} is saved as a {what} view: torch.load applies the bit to its "
        f"bytes, which {doing} would take as they are, changing its values",
        remedies=(*keep, Remedy(text=f"load it, call .{resolve} and save that")),
    )


def sizes_after(
    tree: Any,
    weights_only: bool,
    records: Mapping[int, Any],
    sd: Mapping[Any, Any],
) -> dict[str, int]:
    """Output bytes per category: ``weights`` (the state dict ``sd``), ``optimizer``,
    ``other`` (the rest of ``tree``, unless ``weights_only``), from each storage's record."""
    sizes = {"weights": 0, "optimizer": 0, "other": 0}
    seen: set[int] = set()
    top = [v for v in sd.values() if isinstance(v, (TensorRef, RebuiltTensor))]
    for _, t in iter_stored_tensors(top):
        if id(t.storage) not in seen:
            seen.add(id(t.storage))
            sizes["weights"] += records[id(t.storage)].nbytes
    if not weights_only and isinstance(tree, Mapping):
        for name, value in tree.items():
            category = "optimizer" if str(name).startswith("optim") else "other"
            for _, t in iter_stored_tensors(value):
                if id(t.storage) not in seen:
                    seen.add(id(t.storage))
                    sizes[category] += records[id(t.storage)].nbytes
    return sizes


def categories(
    ckpt: Checkpoint, root: Any, sd_path: Sequence[str], sd: Mapping[Any, Any]
) -> dict[str, int]:
    """Storage bytes per category: ``weights`` (the state dict), ``optimizer``, ``other``."""
    sizes = {"weights": 0, "optimizer": 0, "other": 0}
    seen: set[int] = set()

    def count(tensors: Iterable[TensorRef], category: str) -> None:
        for t in tensors:
            if id(t.storage) not in seen:
                seen.add(id(t.storage))
                sizes[category] += t.storage.nbytes

    # The state dict's tensors, sparse and nested ones' parts too; not its nested containers.
    top = [v for v in sd.values() if isinstance(v, (TensorRef, RebuiltTensor))]
    count((t for _, t in iter_stored_tensors(top)), "weights")
    if isinstance(root, Mapping) and tuple(sd_path) != ():
        for name, value in root.items():
            category = "optimizer" if str(name) in _OPTIMIZER_ENTRIES else "other"
            count((t for _, t in iter_stored_tensors(value)), category)
    return sizes


def execute_plan(
    plan: TransformPlan,
    target: Any,
    source: Checkpoint,
    verify: str = "sizes",
    counter: ByteCounter | None = None,
    durable: bool = True,
    *,
    replace: bool = False,
) -> str:
    """Write ``plan`` to ``target`` through the writer layer; returns what was verified.

    Args:
        plan: the transform's plan.
        target: the output path, accepted by :func:`~ckpt_tools.io.output_path.check_output_path`.
        source: the checkpoint the plan was made from (the first input, for ``average``).
        verify: ``sizes``, ``full`` (every record made again and compared) or ``none``.
        counter: told the byte count of every piece written.
        durable: fsync the output before naming it (see
            :func:`~ckpt_tools.io.atomic.atomic_output`).
        replace: replace a ``target`` that exists (the transform's ``force``).

    Raises:
        UsageError: a verification level transforms do not offer.
        VerificationError / OutputError: the output does not read back or cannot be written.
    """
    check_verify_level(verify, why="cast and averaged bytes differ from the source's by design")
    check_output_size([], plan.output_bytes, target)
    written: list[tuple[str, Record]] = []

    def fill(out: AtomicFile) -> None:
        if plan.output_format == "safetensors":
            write_safetensors(plan.entries, out.file, plan.metadata, counter, durable=out.durable)
            written.extend((name, r) for name, _, r in plan.entries)
            return
        root = source.archive_root or "archive"
        storages = write_plan_zip(
            plan.tree, plan.records, out.file, root, counter, durable=out.durable
        )
        written.extend((f"data/{i}", plan.records[id(s)]) for i, s in enumerate(storages))

    def check(path: str) -> str:
        # ``full`` compares every written record with its record computed again (a cast, a
        # mean) or read again (a copy), not with the source's bytes.
        expected = Expected(plan.expected, plan.select_out, source, rebuilt=True)
        checked = verify_output(path, expected, "sizes" if verify == "full" else verify)
        return check_records(path, written) if verify == "full" else checked

    return write_file(target, fill, check, replace=replace, durable=durable)
