"""``inspect``: what a checkpoint holds, from its structure alone. Never imports torch."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckpt_tools._types import Select, StrPath, checked_path
from ckpt_tools.descriptors import Opaque, RebuiltTensor, TensorRef
from ckpt_tools.formats import Checkpoint, detect_format, open_checkpoint
from ckpt_tools.ops.inspect.entries import describe_value, entries_between_tensors, entries_summary
from ckpt_tools.ops.inspect.info import CheckpointInfo, TensorInfo
from ckpt_tools.structure.selection import (
    Selection,
    a_kind_of,
    counts_as_tensor,
    select_state_dict,
)
from ckpt_tools.structure.tensor_walk import quantizer_tensors, stored_views, tensors_by_place
from ckpt_tools.structure.wrappers import WrapperMatch, detect_wrappers, file_wrapper_rules

__all__ = [
    "CheckpointInfo",
    "TensorInfo",
    "describe_value",
    "inspect",
    "inspect_checkpoint",
    "script_module_tensors",
]


def _selected(ckpt: Checkpoint, select: Select) -> Selection:
    """The state dict to describe: the selection, a TorchScript module's tensors, or (no
    state dict in a root that is no mapping) every tensor of the root by its path."""
    selection = select_state_dict(ckpt.root, select=select)
    if select is None and ckpt.format == "torchscript" and not selection.path:
        flat = script_module_tensors(ckpt.root)
        if flat:
            selection = Selection((), "TorchScript module: its parameters and buffers", flat)
    # torch.save(tensor), torch.save([...]), and a dict root of no state dict whose tensors
    # all lie deeper (an optimizer's): every tensor by its path, sparse, meta and nested too.
    held = selection.found or any(map(_listed, selection.state_dict.values()))
    found = {} if held else tensors_by_place(ckpt.root)  # (a stand-in is never found)
    if selection.stand_in or found:
        why = f"the root is {a_kind_of(ckpt.root)}, no state dict; its tensors by path"
        selection = replace(selection, reason=why, state_dict=found)
    return selection


def _listed(value: Any) -> bool:
    return isinstance(value, (TensorRef, RebuiltTensor))


def _wrappers(ckpt: Checkpoint, sd: Mapping[Any, Any]) -> tuple[WrapperMatch, ...]:
    """The wrapper prefixes of the keys of tensors, a DTensor's (FSDP2) included."""
    names = [k for k, v in sd.items() if isinstance(k, str) and counts_as_tensor(v)]
    rules = file_wrapper_rules(names, path=ckpt.path, fmt=ckpt.format, metadata=ckpt.metadata)
    return detect_wrappers(names, wrappers=rules)


def inspect_checkpoint(ckpt: Checkpoint, select: Select = None) -> CheckpointInfo:
    """Describe an opened checkpoint (see :func:`inspect`)."""
    selection = _selected(ckpt, select)
    sd = selection.state_dict
    listed = [(str(k), v) for k, v in sd.items() if isinstance(v, (TensorRef, RebuiltTensor))]
    named = [(name, t) for name, t in listed if isinstance(t, TensorRef)]
    shard_of = _shard_owner(ckpt)
    tensors = _tensor_infos(listed, shard_of)
    parts = [p for _, t in listed for p in _held_views(t)]
    distinct = {id(p.storage): p.storage.nbytes for p in parts}
    return CheckpointInfo(
        path=ckpt.path,
        format=ckpt.format,
        selected=selection.path,
        selection_reason=selection.reason,
        tensors=tensors,
        wrappers=_wrappers(ckpt, sd),
        unsafe_globals=ckpt.unsafe_globals,
        entries=(
            entries_between_tensors(ckpt.root)
            if selection.stand_in
            else entries_summary(ckpt.root, selection.path, sd)
        ),
        total_params=sum(t.numel for t in tensors),
        total_bytes=sum(t.nbytes for t in tensors),
        storage_bytes=sum(distinct.values()),
        metadata=ckpt.metadata,
        shards=tuple(ckpt.shards),
        shard_of=shard_of,
        pickle_protocol=ckpt.protocol,
        beyond_weights_only=ckpt.beyond_weights_only,
        pickled_module=_module_summary(selection),
        chunks=_dcp_chunks(ckpt, named),
        select=select if select is None or isinstance(select, str) else tuple(select),
        format_info=getattr(ckpt, "zero", None),
    )


def _tensor_infos(
    listed: list[tuple[str, TensorRef | RebuiltTensor]], shard_of: dict[str, str]
) -> tuple[TensorInfo, ...]:
    """One :class:`TensorInfo` per tensor, with the names sharing each storage."""
    # A sparse, nested or quantized tensor's parts are storages too: a part also saved as
    # an entry of its own is memory the two share, as torch.load gives them.
    held = [(name, {id(p.storage): p.storage for p in _held_views(t)}) for name, t in listed]
    by_storage: dict[int, list[str]] = {}
    for name, storages in held:
        for key in storages:
            by_storage.setdefault(key, []).append(name)
    # One tuple per storage, held by each of its tensors: a list of the others per tensor
    # grows with the square of the views of one storage.
    sharing = {key: tuple(names) for key, names in by_storage.items()}
    # Labelled by its first name: a tied name an index records is in no shard of its own.
    label: dict[int, str] = {}
    for name, t in listed:
        for part in stored_views(t):
            label.setdefault(id(part.storage), shard_of.get(name, "") + part.storage.key)
    return tuple(
        _info(name, t, label, _sharing_of(name, storages, sharing, listed))
        for (name, t), (_, storages) in zip(listed, held)
    )


def _sharing_of(
    name: str,
    storages: Mapping[int, Any],
    sharing: dict[int, tuple[str, ...]],
    listed: list[tuple[str, TensorRef | RebuiltTensor]],
) -> tuple[str, ...]:
    """The names viewing any of ``storages`` (``name``'s), in key order."""
    if len(storages) == 1:
        return sharing[next(iter(storages))]
    names = {n for key in storages for n in sharing[key]}
    if len(names) == 1:
        return (name,)
    return tuple(n for n, _ in listed if n in names)


def _held_views(t: Any) -> tuple[TensorRef, ...]:
    """The views whose storages hold ``t``: :func:`stored_views`, and a quantized tensor's
    quantizer tensors (per-channel scales and zero points, saved as storages of their own)."""
    views = stored_views(t)
    return (*views, *(q for v in views for q in quantizer_tensors(v)))


def _info(
    name: str,
    t: TensorRef | RebuiltTensor,
    label: dict[int, str],
    sharing: tuple[str, ...],
) -> TensorInfo:
    """One listed tensor; a sparse, meta or nested one has no storage of its own, and is
    shown with its parts' storages and bytes."""
    own: dict[str, Any]
    if isinstance(t, RebuiltTensor):
        storages = {id(p.storage): p.storage for p in t.parts}
        own = {
            "storage": ",".join(label[key] for key in storages),
            "offset": 0,
            "storage_nbytes": sum(s.nbytes for s in storages.values()),
            "sharing": sharing,
            "layout": t.layout,
        }
    else:
        own = {
            "storage": label[id(t.storage)],
            "offset": t.offset,
            "storage_nbytes": t.storage.nbytes,
            "sharing": sharing,
            "is_parameter": t.is_parameter,
        }
    return TensorInfo(
        name=name,
        dtype=t.dtype,
        shape=t.shape,
        stride=t.stride,
        numel=t.numel,
        nbytes=t.nbytes,
        device=t.device,
        **own,
    )


def _module_summary(selection: Selection) -> dict[str, Any] | None:
    module = selection.module
    if module is None:
        return None
    return {
        "class": module.class_name,
        "modules": module.modules,
        "tensors": sum(isinstance(v, TensorRef) for v in module.state_dict.values()),
        "caveats": list(module.caveats),
    }


def _dcp_chunks(ckpt: Checkpoint, named: list[tuple[str, TensorRef]]) -> dict[str, tuple[Any, ...]]:
    """Each DCP tensor's chunks, as :attr:`CheckpointInfo.chunks` lists them."""
    if ckpt.format != "dcp":
        return {}  # the DCP reader is imported only where a DCP folder was opened
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint

    if not isinstance(ckpt, DcpCheckpoint):
        return {}
    found: dict[str, tuple[Any, ...]] = {}
    for name, t in named:
        if id(t) in ckpt.tensors:
            found[name] = tuple(
                {
                    "offsets": c.offsets,
                    "sizes": c.sizes,
                    "file": c.file,
                    "offset": c.offset,
                    "length": c.length,
                }
                for c in ckpt.item_of(t).chunks
            )
    return found


def script_module_tensors(root: Any) -> dict[str, TensorRef]:
    """The tensors of a TorchScript module tree by dotted name, as ``state_dict()`` names them.

    A TorchScript archive pickles each module as an object whose state maps its attribute
    names to tensors, submodules and plain values. Tensor attributes that are neither
    parameters nor buffers are listed too: telling them apart needs the archive's code.
    """
    found: dict[str, TensorRef] = {}
    seen: set[int] = set()

    def walk(node: Any, prefix: str) -> None:
        if id(node) in seen or not isinstance(node, Opaque) or not isinstance(node.state, Mapping):
            return
        seen.add(id(node))
        for key, value in node.state.items():
            if isinstance(value, TensorRef):
                found[f"{prefix}{key}"] = value
            else:
                walk(value, f"{prefix}{key}.")

    walk(root, "")
    return found


def _shard_owner(ckpt: Checkpoint) -> dict[str, str]:
    if not ckpt.shards:
        return {}
    owner: dict[str, str] = {}
    for shard, sub in ckpt.shards.items():
        for name in sub.root if isinstance(sub.root, Mapping) else ():
            owner[str(name)] = f"{shard}:"
    return owner


def inspect(path: StrPath, *, select: Select = None) -> CheckpointInfo:
    """Describe a checkpoint without importing torch or reading tensor bytes.

    Args:
        path: a checkpoint file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``, ``.safetensors``, legacy
            or tar torch files, pickles), a sharded folder, or a PEFT adapter folder (its
            config is the result's ``format_info``); or the URL of a file or folder
            (``https://``, ``hf://ORG/REPO[@REV][/PATH]``, ``s3://BUCKET/KEY``), read by
            byte ranges: only its structure is fetched (the result's ``transfer`` says
            what it cost).
        select: a dotted path to the state dict, overriding the automatic choice.

    Returns:
        A :class:`CheckpointInfo`.

    Raises:
        CheckpointError: the file is missing, corrupt, unsupported, or ``select`` is wrong.

    Example:
        >>> info = inspect("ddp.pt")
        >>> info.format, info.wrappers[0].prefix, info.total_params
        ('torch-zip', 'module.', 572)
    """
    path = checked_path(path)
    if "://" in path:
        from ckpt_tools.io.remote.urls import is_url

        if is_url(path):
            return _inspect_url(path, select)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a PEFT adapter folder
        from ckpt_tools.ops.merge.info import inspect_adapter

        return inspect_adapter(path, select)
    return inspect_checkpoint(_as_named(path, open_checkpoint(path)), select)


def _as_named(path: str, ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` as the user named it: a folder holding one weight file and no index is
    reported as that folder (``hf-sharded``, the file its one shard), as a folder with an
    index is.

    The reader opens such a folder as its one file (so a rewrite keeps that file's format);
    a report naming ``FOLDER/model.safetensors`` and ``safetensors`` would not say that the
    folder is a Hugging Face folder, nor match :func:`~ckpt_tools.formats.detect_format`.
    """
    if ckpt.format == "hf-sharded" or not os.path.isdir(path):
        return ckpt
    if detect_format(path) != "hf-sharded":  # a DCP or DeepSpeed folder is itself
        return ckpt
    folder, name = os.path.split(ckpt.path)
    return replace(ckpt, path=folder, format="hf-sharded", shards={name: ckpt})


def _inspect_url(url: str, select: Select) -> CheckpointInfo:
    """Inspect the checkpoint at ``url``, with what reading it cost; a folder URL whose
    search found one weight file is reported as that folder, as :func:`_as_named` reports
    a local one (the URL as given, its ``/`` kept)."""
    from ckpt_tools.io.remote import RemoteSession
    from ckpt_tools.io.remote.checkpoint import open_url
    from ckpt_tools.io.remote.urls import file_name, is_folder_url

    with RemoteSession() as session:
        ckpt = open_url(url, session=session)
        if ckpt.format != "hf-sharded" and is_folder_url(url):
            shards = {file_name(ckpt.path): ckpt}
            ckpt = replace(ckpt, path=session.named(url), format="hf-sharded", shards=shards)
        info = inspect_checkpoint(ckpt, select)
    return replace(info, transfer=session.stats)
