"""How ``consolidate``'s plan reaches the writer layer, and how its outputs are checked.

Each output tensor becomes one :class:`~ckpt_tools.io.writers.records.Record` made of DCP
chunk pieces (dim-0 slices copied by the copy engine, other layouts assembled through a
bounded buffer). A ``.pt`` is written by :func:`~ckpt_tools.io.writers.plan.write_plan_zip`,
a ``.safetensors`` and each Hugging Face shard by
:func:`~ckpt_tools.io.writers.safetensors.write_safetensors`, every file through
:func:`~ckpt_tools.io.writers.output.write_file` and a folder through
:func:`~ckpt_tools.io.writers.hf_folder.write_hf_shards`. Unless ``verify='none'``, each file
is read back before it is named: every planned tensor, in order, with its dtype and shape,
and with ``verify='full'`` every record's bytes, made again from the chunks. A tied name a
safetensors output stores once is recorded in its metadata (``{tied name: stored name}``,
the index's in a sharded folder), as ``convert`` and ``merge-lora`` record it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import CheckpointError, VerificationError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.assemble import SpanPiece
from ckpt_tools.io.atomic import AtomicFile
from ckpt_tools.io.verify.levels import NOT_VERIFIED
from ckpt_tools.io.verify.zipcheck import check_torch_zip
from ckpt_tools.io.writers.hf_folder import write_hf_shards
from ckpt_tools.io.writers.output import Check, write_file
from ckpt_tools.io.writers.plan import write_plan_zip
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.records import Record, check_records
from ckpt_tools.io.writers.safetensors import write_safetensors
from ckpt_tools.io.writers.shard_plan import ShardPlan
from ckpt_tools.io.writers.torchzip import picklable_tensors
from ckpt_tools.ops.consolidate.plan import ConsolidationPlan, OutputTensor
from ckpt_tools.structure.tensor_walk import iter_stored_tensors

__all__ = ["write_file_output", "write_folder_output"]


def write_file_output(
    dst: Path,
    fmt: str,
    plan: ConsolidationPlan,
    verify: str,
    counter: ByteCounter | None,
    durable: bool,
    replace: bool,
) -> str:
    """One ``.pt`` (``fmt='torch-zip'``) or ``.safetensors`` file at ``dst``, replacing one
    there only with ``replace``; returns what was verified."""
    written: list[tuple[str, Record]] = []
    if fmt == "torch-zip":
        records = {id(t.tensor.storage): _record(t) for t in plan.tensors}
        tree = _picklable(plan.tree, records)

        def fill(out: AtomicFile) -> None:
            used = write_plan_zip(tree, records, out.file, "archive", counter, durable=out.durable)
            written.extend((f"data/{i}", records[id(s)]) for i, s in enumerate(used))

    else:
        entries = [(t.name, t.tensor, _record(t)) for t in plan.tensors]
        written.extend((name, r) for name, _, r in entries)
        # Each tied name left out maps to its stored name, as convert and merge-lora (and
        # huggingface_hub) write it: without it, loading the file loses that name.
        metadata = {**plan.tie_metadata, "format": "pt"}

        def fill(out: AtomicFile) -> None:
            write_safetensors(entries, out.file, metadata, counter, durable=out.durable)

    aliases = plan.aliases if fmt != "torch-zip" else {}
    check = _check(plan.tensors, written, verify, aliases, plan.tree)
    return write_file(dst, fill, check, replace=replace, durable=durable)


def write_folder_output(
    dst: Path,
    plan: ConsolidationPlan,
    shards: ShardPlan,
    verify: str,
    counter: ByteCounter | None,
    jobs: int,
    durable: bool,
    replace: bool,
) -> tuple[str, ...]:
    """Hugging Face shards and their index, published as the folder ``dst`` (into a
    non-empty one only with ``replace``); returns the names written inside it. The tied
    names the plan stores once go into the index's metadata, or the single file's."""
    by_name = {t.name: t for t in plan.tensors}
    entries = [(t.name, t.tensor, _record(t)) for t in plan.tensors]
    records = {name: record for name, _, record in entries}
    # write_hf_shards puts them in the index when there is one: the shards then hold none.
    in_file = {} if shards.is_sharded else plan.aliases

    def check(names: Sequence[str]) -> Check:
        tensors = [by_name[n] for n in names]
        return _check(tensors, [(n, records[n]) for n in names], verify, in_file)

    return write_hf_shards(
        entries,
        dst,
        shards,
        check,
        metadata=plan.tie_metadata,
        counter=counter,
        jobs=jobs,
        durable=durable,
        replace=replace,
    )


def _record(t: OutputTensor) -> Record:
    """The record of one output tensor: its chunk pieces, back to back."""
    if t.record is not None:
        return t.record
    copied = all(isinstance(p, SpanPiece) for p in t.pieces)
    return Record(t.tensor.nbytes, pieces=t.pieces, action="copy" if copied else "assemble")


def _check(
    tensors: Sequence[OutputTensor],
    written: Sequence[tuple[str, Record]],
    verify: str,
    aliases: Mapping[str, str],
    tree: Any = None,
) -> Check:
    """The file reads back with every planned tensor, in order, with its dtype and shape
    (a ``.pt``: every tensor of ``tree``, wherever it lies), and with each tied name of
    ``aliases`` its metadata records; with ``full``, every record's bytes are made again and
    compared too."""

    def check(path: str) -> str:
        if verify == "none":
            return NOT_VERIFIED
        _verify(path, tensors, aliases, tree)
        if verify == "full":
            return check_records(path, written)
        return "verified: keys and sizes"

    return check


def _verify(
    path: str, tensors: Sequence[OutputTensor], aliases: Mapping[str, str], tree: Any
) -> None:
    try:
        out = open_checkpoint(path)
    except CheckpointError as e:
        raise VerificationError(f"the written file does not read back: {e}") from e
    if out.format == "torch-zip":
        check_torch_zip(path)  # raises its own VerificationError, worded for the output
    if out.format == "safetensors":
        got = [(k, t.dtype, t.shape) for k, t in out.root.items()]
        by_name = {t.name: t.tensor for t in tensors}
        # The reader gives each tied name back from the metadata, as its stored tensor.
        restored = {a: by_name[k] for a, k in aliases.items() if k in by_name}
        want = [(n, t.dtype, t.shape) for n, t in {**by_name, **restored}.items()]
        if sorted(got) != sorted(want):
            raise VerificationError("the written safetensors file's tensors differ from the plan")
        return
    # Every tensor the tree holds (in tuples and rebuilt tensors too), with its storage's size.
    got = _layout(out.root)
    if got != _layout(tree):
        raise VerificationError("the written file's tensors differ from the plan")


def _layout(tree: Any) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...], int]]:
    return [
        (name, t.dtype, t.shape, t.stride, t.storage.nbytes)
        for name, t in iter_stored_tensors(tree)
    ]


def _picklable(node: Any, records: dict[int, Record], made: dict[int, Any] | None = None) -> Any:
    """The tree with every tensor given torch.save's rebuild call (``picklable_tensors``); a
    tensor the tree holds twice (tied names) stays one tensor, over one storage. Each new
    storage is given its tensor's record in ``records`` (by id, as the writer looks it up);
    a saved value's tensors, which already have their call, are kept as they are."""
    made = {} if made is None else made
    if isinstance(node, TensorRef):
        if id(node) not in made:
            made[id(node)] = picklable_tensors({0: node})[0]
            records[id(made[id(node)].storage)] = records[id(node.storage)]
        return made[id(node)]
    if type(node) is dict:
        out = picklable_tensors(node)  # the mapping's type and its _metadata kept
        out.update((k, _picklable(v, records, made)) for k, v in node.items())
        return out
    if type(node) in (list, tuple):
        items = [_picklable(v, records, made) for v in node]
        return items if type(node) is list else tuple(items)
    return node
