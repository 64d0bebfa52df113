"""Writing a (rewritten) object tree as a torch zip archive.

Tensor bytes are copied from the source file record by record (``copy_file_range`` where
possible); nothing holds a whole checkpoint in memory, and torch is never imported.
Safetensors outputs are written by :mod:`ckpt_tools.io.writers.safetensors`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

from ckpt_tools.descriptors import StorageRef, TensorRef
from ckpt_tools.errors import ConversionError
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.pickle.repickle import TORCH_PICKLE_PROTOCOL, dumps, torch_storage_id
from ckpt_tools.io.copy.layout import (
    LAYOUT_BLOCK,
    CappedProgress,
    plan_zip_layout,
    zip_actions,
)
from ckpt_tools.io.tensor_bytes import decompressed
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.saved_tensors import saved_storage, saved_tensor
from ckpt_tools.io.writers.zipfile import SAVE_HEAD_RECORDS, SAVE_VERSION, TorchZipWriter
from ckpt_tools.structure.attributes import carry_attributes

__all__ = ["picklable_tensors", "write_save_layout", "write_torch_zip"]


def write_torch_zip(
    tree: Any,
    source: Checkpoint,
    file: BinaryIO,
    device_map: Mapping[str, str] | None = None,
    counter: ByteCounter | None = None,
    added: Mapping[str, bytes] | None = None,
    *,
    durable: bool,
) -> list[StorageRef]:
    """Write ``tree`` (read from ``source``, possibly edited) as a torch zip archive.

    From a zip source, every record is copied as it is (same names, same CRCs) except
    ``data.pkl`` and the records torch parses (versions, alignment, byte order), which are
    written as torch.save writes them; storage records no longer referenced are left out.
    From other formats, storages become ``data/0``, ``data/1``, ... and torch's bookkeeping
    records are added.

    Args:
        tree: the object tree to pickle.
        source: the checkpoint the tree's storages live in.
        file: the output, opened ``w+b``.
        device_map: saved device tag -> new tag (``{"cuda:1": "cpu"}``).
        counter: told the byte count of every piece of tensor data written.
        added: storage key -> bytes, for storages the tree holds that are not in
            ``source`` (``sanitize`` turns numpy arrays into these); written as new records
            after the copied ones.
        durable: whether the output will be fsynced (``AtomicFile.durable``).

    Returns:
        The storages copied from ``source``, in order.

    Raises:
        ConversionError: legacy storage views, which are not moved onto their roots.
        OSError: reading the source or writing the output failed.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.pt")
        >>> with open("on_gpu.pt", "w+b") as f:
        ...     stored = write_torch_zip(
        ...         ckpt.root, ckpt, f, device_map={"cpu": "cuda:0"}, durable=False
        ...     )
        >>> len(stored), {t.device for t in open_checkpoint("on_gpu.pt").root.values()}
        (17, {'cuda:0'})
    """
    from_zip = source.format in ("torch-zip", "torchscript")
    keys: dict[int, str] = {}
    used: list[StorageRef] = []
    new_records: list[tuple[str, bytes]] = []

    def storage_id(storage: StorageRef) -> tuple[Any, ...]:
        if storage.view is not None:
            raise ConversionError(
                f"storage {storage.key!r} is a legacy storage view (torch < 1.0), which a zip "
                "archive holds only on its root storage, and tensors on it are not moved there "
                "here; torch.load it with a current torch and torch.save it (a zip archive), or "
                "write safetensors"
            )
        if id(storage) not in keys:
            keys[id(storage)] = storage.key if from_zip else str(len(keys))
            if added is not None and storage.key in added:
                new_records.append((f"data/{keys[id(storage)]}", added[storage.key]))
            else:
                used.append(storage)
        device = (device_map or {}).get(storage.device, storage.device)
        return torch_storage_id(storage, keys[id(storage)], device)

    payload = dumps(tree, TORCH_PICKLE_PROTOCOL, storage_id)
    writer = TorchZipWriter(file, source.archive_root or "archive", durable=durable)
    src_fd = os.open(source.path, os.O_RDONLY) if used or from_zip else -1
    try:
        bytes_from = _RecordSource(source, src_fd, counter)
        records = [(f"data/{keys[id(s)]}", s) for s in used]
        if from_zip:
            _copy_zip_records(writer, bytes_from, payload, {name for name, _ in records})
            _add_bytes(writer, new_records, counter)
            writer.close()
        else:
            _add_new_records(writer, bytes_from, payload, records, new_records)
    finally:
        if src_fd >= 0:
            os.close(src_fd)
    return used


class _RecordSource(NamedTuple):
    """Where records' bytes come from: the source checkpoint, its open file, who is told."""

    ckpt: Checkpoint
    fd: int
    counter: ByteCounter | None


def _copy_zip_records(
    writer: TorchZipWriter, src: _RecordSource, payload: bytes, wanted: set[str]
) -> None:
    """A zip source's records as they are (names, CRCs), a new data.pkl, unused data left out.

    Records copied unchanged keep their local headers and their offsets modulo 4096, and
    each run of them is one copy (:mod:`ckpt_tools.io.copy.layout`).

    Compressed records (a re-zipping tool deflates them; torch reads such archives) are
    decompressed, in bounded pieces, and written stored: copying their bytes as they are
    would make stored records of compressed bytes, which nothing can read. The records
    torch parses (versions, alignment, byte order) hold what torch.save writes: copied
    where the source holds exactly that, written anew (torch.save's values) otherwise.
    """
    as_saved = dict((*SAVE_HEAD_RECORDS, SAVE_VERSION))
    actions = zip_actions(src.ckpt, src.fd, as_saved, wanted)
    layout = plan_zip_layout(src.ckpt, src.fd, actions)
    in_runs: set[str] = set()
    for name, action in actions:
        record = src.ckpt.records[name]
        run = layout.runs.get(name)
        told = CappedProgress(src.counter, run.tensor_bytes if run else 0)
        if run is not None and writer.add_run(src.fd, run.start, run.end, run.records, told):
            in_runs.update(r[0] for r in run.records)
            told.finish()
        if name in in_runs:
            as_saved.pop(name, None)
            continue
        if name in layout.end_before:
            writer.end_next_record_at(layout.end_before[name], LAYOUT_BLOCK)
        if name == "data.pkl":
            writer.add_bytes(name, payload)
        elif name in as_saved:
            writer.add_bytes(name, as_saved.pop(name))  # in place: a torch.save file stays same
        elif action == "skip":
            continue
        else:
            # Progress counts tensor bytes only, not torch's bookkeeping records.
            counted = src.counter if name.startswith("data/") else None
            if record.compressed:
                with decompressed(src.ckpt, name) as chunks:
                    writer.add_stream(name, chunks, record.size, counted)
            else:
                crc = record.crc32 or None  # 0: torch computed none, so it is computed here
                writer.add_copy(name, src.fd, record.data_offset, record.size, crc, counted)
    for name, value in as_saved.items():  # those the source lacks
        writer.add_bytes(name, value)


def _add_new_records(
    writer: TorchZipWriter,
    src: _RecordSource,
    payload: bytes,
    records: Sequence[tuple[str, StorageRef]],
    added: Sequence[tuple[str, bytes]],
) -> None:
    """The records ``torch.save`` writes, for a source that is not a torch zip archive."""

    def add_storages() -> None:
        for name, storage in records:
            span = src.ckpt.span(storage)
            fd = src.fd if span.path == src.ckpt.path else os.open(span.path, os.O_RDONLY)
            try:
                writer.add_copy(name, fd, span.offset, span.nbytes, None, src.counter)
            finally:
                if fd != src.fd:
                    os.close(fd)
        _add_bytes(writer, added, src.counter)

    write_save_layout(writer, payload, add_storages)


def _add_bytes(
    writer: TorchZipWriter, added: Sequence[tuple[str, bytes]], counter: ByteCounter | None
) -> None:
    """New storage records (numpy arrays' bytes, from ``sanitize``), counted as written."""
    for name, data in added:
        writer.add_bytes(name, data)
        if counter is not None:
            counter(len(data))


def picklable_tensors(sd: Mapping[str, Any]) -> dict[str, Any]:
    """Give tensors read from formats without a pickle (safetensors) torch's rebuild call.

    Each gets the storage class and rebuild call ``torch.save`` writes for its dtype
    (:mod:`~ckpt_tools.io.writers.saved_tensors`).
    """
    # Keep the mapping's type (state dicts are OrderedDicts) and its attributes: torch's
    # load_state_dict reads module versions from ``_metadata``.
    out: dict[str, Any] = type(sd)() if isinstance(sd, dict) else {}
    carry_attributes(sd, out)
    # One re-typed storage per storage: tied names (a safetensors alias) stay tied.
    retyped: dict[int, StorageRef] = {}
    for name, t in sd.items():
        if not isinstance(t, TensorRef) or t.func is not None:
            out[name] = t
            continue
        storage = retyped.setdefault(id(t.storage), saved_storage(t.storage, t.dtype))
        out[name] = saved_tensor(t, storage, t.dtype)
    return out


def write_save_layout(
    writer: TorchZipWriter, payload: bytes, add_storages: Callable[[], None]
) -> None:
    """The records ``torch.save`` writes, in its order, then the archive's end records.

    ``data.pkl`` (``payload``), the bookkeeping records torch parses, the storage records
    (``add_storages`` adds them), the format version, and a new serialization id.

    Example:
        >>> import pickle, zipfile
        >>> with open("tiny.pt", "w+b") as f:
        ...     w = TorchZipWriter(f, "tiny", durable=False)
        ...     write_save_layout(w, pickle.dumps({}, protocol=2), lambda: None)
        >>> zipfile.ZipFile("tiny.pt").namelist()[-2:]
        ['tiny/version', 'tiny/.data/serialization_id']
    """
    writer.add_bytes("data.pkl", payload)
    for head, value in SAVE_HEAD_RECORDS:
        writer.add_bytes(head, value)
    add_storages()
    writer.add_bytes(*SAVE_VERSION)
    import uuid  # only new archives need an id

    writer.add_bytes(".data/serialization_id", str(uuid.uuid4().int)[:20].encode())
    writer.close()
