"""How ``consolidate`` writes: the torch.save layout, one safetensors file, or HF shards.

Each file is written atomically (:mod:`ckpt_tools.io.atomic`) and, unless ``verify='none'``,
read back before it is named: every planned tensor, in order, with its dtype and shape.
"""

from __future__ import annotations

import functools
import os
import struct
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import CheckpointError, OutputError, OutputExistsError, VerificationError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle.repickle import TORCH_PICKLE_PROTOCOL, dumps, torch_storage_id
from ckpt_tools.io.assemble import write_pieces
from ckpt_tools.io.atomic import AtomicFile, atomic_output
from ckpt_tools.io.verify.zipcheck import check_torch_zip
from ckpt_tools.io.writers.safetensors import SafetensorsEntry, safetensors_header
from ckpt_tools.io.writers.shard_plan import INDEX_NAME, index_bytes, plan_shards
from ckpt_tools.io.writers.torchzip import picklable_tensors
from ckpt_tools.io.writers.zipfile import SAVE_HEAD_RECORDS, SAVE_VERSION, TorchZipWriter, Writeback
from ckpt_tools.ops.consolidate.plan import ConsolidationPlan, OutputTensor

__all__ = ["shard_outputs", "write_file", "write_shards"]


def write_file(
    dst: str, fmt: str, plan: ConsolidationPlan, verify: str, durable: bool = True
) -> None:
    """One ``.pt`` (``fmt='torch-zip'``) or ``.safetensors`` file at ``dst``, atomically."""
    write = _write_torch if fmt == "torch-zip" else _write_safetensors
    _atomic(dst, lambda out: write(plan, out), plan.tensors, verify, durable)


def _atomic(
    dst: str, write: Any, tensors: Sequence[OutputTensor], verify: str, durable: bool
) -> None:
    with atomic_output(dst, durable=durable) as out:
        write(out)
        out.file.flush()
        if verify != "none":
            _verify(str(out.path), tensors)


def _verify(path: str, tensors: Sequence[OutputTensor]) -> None:
    """The file reads back with every planned tensor, in order, with its dtype and shape."""
    try:
        out = open_checkpoint(path)
        if out.format == "torch-zip":
            check_torch_zip(path)
    except CheckpointError as e:
        raise VerificationError(f"the written file does not read back: {e}") from e
    found = [t for t in _tensors_in(out.root)]
    if out.format == "safetensors":
        got = [(k, t.dtype, t.shape) for k, t in out.root.items()]
        want = [(t.name, t.tensor.dtype, t.tensor.shape) for t in tensors]
        if sorted(got) != sorted(want):
            raise VerificationError("the written safetensors file's tensors differ from the plan")
        return
    got = [(t.dtype, t.shape, t.stride, t.storage.nbytes) for t in found]
    want = [(t.tensor.dtype, t.tensor.shape, t.tensor.stride, t.tensor.nbytes) for t in tensors]
    if got != want:
        raise VerificationError("the written file's tensors differ from the plan")


def _tensors_in(node: Any) -> list[TensorRef]:
    if isinstance(node, TensorRef):
        return [node]
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return [t for v in values for t in _tensors_in(v)]


def _picklable(node: Any) -> Any:
    if isinstance(node, dict):
        node = picklable_tensors(node)
        return {k: _picklable(v) if isinstance(v, (dict, list)) else v for k, v in node.items()}
    if isinstance(node, list):
        return [
            _picklable(v) if isinstance(v, (dict, list)) else picklable_tensors({0: v})[0]
            for v in node
        ]
    return picklable_tensors({0: node})[0]


def _write_torch(plan: ConsolidationPlan, out: AtomicFile) -> None:
    """The torch.save layout: data.pkl, torch's bookkeeping records, one record per tensor."""
    payload = dumps(
        _picklable(plan.tree),
        TORCH_PICKLE_PROTOCOL,
        lambda s: torch_storage_id(s, s.key, "cpu"),
    )
    writer = TorchZipWriter(out.file, "archive", durable=out.durable)
    writer.add_bytes("data.pkl", payload)
    for head, value in SAVE_HEAD_RECORDS:
        writer.add_bytes(head, value)
    for t in plan.tensors:
        pieces = t.pieces

        def fill(fd: int, at: int, writeback: Writeback, pieces: Any = pieces) -> int:
            return write_pieces(fd, at, pieces, writeback)

        writer.add_written(f"data/{t.tensor.storage.key}", t.tensor.nbytes, fill)
    writer.add_bytes(*SAVE_VERSION)
    writer.add_bytes(".data/serialization_id", str(uuid.uuid4().int)[:20].encode())
    writer.close()


def _write_safetensors(
    plan: ConsolidationPlan, out: AtomicFile, tensors: Sequence[OutputTensor] | None = None
) -> None:
    tensors = plan.tensors if tensors is None else tensors
    entries = [SafetensorsEntry(t.name, t.tensor) for t in tensors]
    raw = safetensors_header(entries, {"format": "pt"})
    fd = out.file.fileno()
    os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
    at = 8 + len(raw)
    writeback = Writeback(fd, durable=out.durable)
    for t in tensors:
        write_pieces(fd, at, t.pieces, writeback)
        at += t.tensor.nbytes
    os.ftruncate(fd, at)


def shard_outputs(
    plan: ConsolidationPlan, folder: str, limit: int, force: bool
) -> tuple[Any, list[str], list[str]]:
    """The shard plan, the paths it writes (shards, then the index), and stale shards to
    remove; refuses what writing would refuse, and creates nothing."""
    shards = plan_shards([(t.name, t.tensor.nbytes) for t in plan.tensors], limit)
    names = [file for file, _ in shards.files]
    out = Path(folder)
    if not out.exists() and not out.parent.is_dir():
        raise OutputError(
            f"the output folder's parent {str(out.parent)!r} does not exist", path=folder
        )
    paths = [str(out / n) for n in names] + ([str(out / INDEX_NAME)] if len(names) > 1 else [])
    # Shards of an earlier consolidation would sit beside ours under another count, and
    # its index would name them: the folder would hold two checkpoints.
    found = out.glob("model*.safetensors*") if out.is_dir() else ()
    stale = sorted(str(p) for p in found if str(p) not in paths)
    for p in paths + stale:
        if os.path.lexists(p) and not force:
            raise OutputExistsError(p)
    return shards, paths, stale


def write_shards(
    plan: ConsolidationPlan,
    folder: str,
    limit: int,
    jobs: int,
    force: bool,
    verify: str,
    durable: bool = True,
) -> tuple[str, ...]:
    """HF shards and their index, each file atomic; the index is written last."""
    by_name = {t.name: t for t in plan.tensors}
    shards, paths, stale = shard_outputs(plan, folder, limit, force)
    durable = durable or bool(stale)  # old shards are removed: the new ones must be on disk
    names = [file for file, _ in shards.files]
    groups = [list(members) for _, members in shards.files]
    Path(folder).mkdir(exist_ok=True)

    def one(i: int) -> None:
        tensors = [by_name[n] for n in groups[i]]
        write = functools.partial(_write_safetensors, plan, tensors=tensors)
        _atomic(paths[i], write, tensors, verify, durable)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, range(len(groups))))
    if len(names) > 1:
        with atomic_output(paths[-1], durable=durable) as out:
            out.file.write(index_bytes(shards))
    for p in stale:
        os.unlink(p)  # (only with force) after ours are complete
    return tuple(paths)
