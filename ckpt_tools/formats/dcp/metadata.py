"""The ``.metadata`` pickle of a torch.distributed.checkpoint (DCP) folder, read as data.

The pickle names DCP's dataclasses (``Metadata``, ``TensorStorageMetadata``, ``_StorageInfo``
...); they resolve to :class:`~ckpt_tools.formats.dcp.globals.DataStandIn` classes for this
pickle only, and this module reads their recorded BUILD states back into frozen dataclasses,
checking every field as hostile input: each chunk lies within its tensor and its bytes
within its file, a tensor's chunks cover it exactly once, and each item names one
storage entry. Transforms DCP records that we cannot undo (compression) are refused by name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.dtypes import DTYPE_ITEMSIZE
from ckpt_tools.errors import CorruptCheckpointError, UnsafeContentError, UnsupportedFormatError
from ckpt_tools.formats.dcp.globals import ENUM_GETATTR, DataStandIn, dcp_metadata_stand_ins
from ckpt_tools.formats.detect import check_regular
from ckpt_tools.formats.pickle.standins import ConstantRef, Reduced, is_count
from ckpt_tools.formats.pickle.unpickler import MAX_NESTING, load_pickle

__all__ = [
    "MAX_METADATA_BYTES",
    "DcpBytes",
    "DcpChunk",
    "DcpMetadata",
    "DcpTensor",
    "load_metadata_pickle",
    "parse_metadata",
    "read_metadata",
]

# A .metadata pickle grows with the number of chunks (about 300 bytes each); 256 MiB is far
# past any checkpoint's and bounds what we hold.
MAX_METADATA_BYTES = 256 << 20


@dataclass(frozen=True)
class DcpChunk:
    """One saved piece of a tensor: a hyperrectangle and where its bytes lie.

    Attributes:
        offsets: its first element's index in the global tensor, per dimension.
        sizes: its extent, per dimension.
        file: the ``.distcp`` file (a name in the folder).
        offset: where its serialized bytes start in that file.
        length: how many bytes they take (a whole ``torch.save`` archive).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    """A tensor of the saved state dict: global dtype and shape, and its chunks."""

    fqn: str
    path: tuple[str | int, ...]
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    chunks: tuple[DcpChunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class DcpBytes:
    """A non-tensor value (``BYTE_IO``): a ``torch.save`` archive at ``offset`` in ``file``."""

    fqn: str
    path: tuple[str | int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    """What a DCP ``.metadata`` file says, checked.

    Attributes:
        items: fqn -> tensor or value, in the order the pickle lists them.
        version: DCP's format version (``"1.0.0"``), None before torch 2.9.
        files: the data files the items lie in, sorted.
    """

    items: Mapping[str, DcpTensor | DcpBytes]
    version: str | None
    files: tuple[str, ...]


def _bad(path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path!r} is not a valid DCP metadata file: {why}", path=path)


def _fields(obj: Any, cls: str, path: str) -> dict[str, Any]:
    """The BUILD state of a stand-in of DCP class ``cls``, as a dict."""
    if not isinstance(obj, DataStandIn) or type(obj).global_ref.name != cls:
        raise _bad(path, f"expected a {cls}, found {short_repr(obj, 80)}")
    if obj.args or obj.listitems or obj.dictitems or not obj.newobj:
        raise _bad(path, f"its {cls} is built by a call, not as a dataclass is pickled")
    state = obj.state if obj.has_state else {}
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise _bad(path, f"its {cls} has state {short_repr(state, 80)}, not a field dict")
    return state


def _ints(value: Any, what: str, path: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(is_count(v) for v in value):
        raise _bad(path, f"{what} is {short_repr(value, 80)}, not a tuple of sizes")
    return tuple(value)


_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def _dtype(props: Any, fqn: str, path: str) -> tuple[str, bool]:
    """(dtype, requires_grad) from a TensorProperties: its state is a 5-tuple, or a dict."""
    if not isinstance(props, DataStandIn) or type(props).global_ref.name != "TensorProperties":
        raise _bad(path, f"{fqn!r} has properties {short_repr(props, 80)}")
    state = props.state
    if isinstance(state, tuple) and len(state) == 5:
        dtype, layout, requires_grad = state[0], state[1], state[2]
    elif isinstance(state, dict):
        dtype, layout, requires_grad = (state.get(k) for k in ("dtype", "layout", "requires_grad"))
    else:
        raise _bad(path, f"{fqn!r} has properties state {short_repr(state, 80)}")
    if (
        not isinstance(dtype, ConstantRef)
        or dtype.module != "torch"
        or dtype.name not in DTYPE_ITEMSIZE
    ):
        raise _bad(path, f"{fqn!r} has dtype {short_repr(dtype, 60)}")
    if dtype.name in _QUANTIZED:
        # DCP saves a quantized tensor's integers only: its scale and zero point are lost.
        raise UnsupportedFormatError(
            f"{path!r}: {fqn!r} is a {dtype.name} (quantized) tensor, whose scale and zero "
            "point DCP does not record, so it cannot be rebuilt; dequantize it before saving",
            path=path,
        )
    strided = layout is None or (isinstance(layout, Reduced) and layout.args == ("torch.strided",))
    if not strided:
        raise UnsupportedFormatError(
            f"{path!r}: {fqn!r} has layout {short_repr(layout, 60)}; only strided (dense) "
            "tensors can be read",
            path=path,
        )
    return dtype.name, bool(requires_grad)


def _storage_index(storage_data: Any, path: str) -> dict[tuple[str, Any], dict[str, Any]]:
    """``(fqn, chunk offsets or None) -> _StorageInfo fields``."""
    if not isinstance(storage_data, dict):
        raise _bad(path, f"storage_data is {short_repr(storage_data, 60)}, not a dict")
    index: dict[tuple[str, Any], dict[str, Any]] = {}
    for key, info in storage_data.items():
        k = _fields(key, "MetadataIndex", path)
        fqn, offset = k.get("fqn"), k.get("offset")
        if not isinstance(fqn, str):
            raise _bad(path, f"a storage entry names {short_repr(fqn, 60)}, not a key")
        where = (fqn, None if offset is None else _ints(offset, f"{fqn!r}'s chunk offset", path))
        if where in index:
            raise _bad(path, f"{fqn!r} has two storage entries for chunk {where[1]}")
        fields = _fields(info, "_StorageInfo", path)
        transforms = fields.get("transform_descriptors")
        if transforms:
            raise UnsupportedFormatError(
                f"{path!r}: {fqn!r} was saved through transforms {short_repr(transforms, 80)} "
                "(a DCP extension such as stream.zstd), which ckpt_tools cannot undo; "
                "load it with torch.distributed.checkpoint instead",
                path=path,
            )
        index[where] = fields
    return index


def _location(
    fields: dict[str, Any], fqn: str, folder: str, sizes: dict[str, int], path: str
) -> tuple[str, int, int]:
    name, offset, length = (fields.get(k) for k in ("relative_path", "offset", "length"))
    if not isinstance(name, str) or not is_count(offset) or not is_count(length):
        raise _bad(path, f"{fqn!r} has storage {short_repr(fields, 100)}")
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise _bad(path, f"{fqn!r} lies in {name!r}, which is not a file name inside the folder")
    if name not in sizes:
        where = os.path.join(folder, name)
        if not os.path.isfile(where):
            raise CorruptCheckpointError(
                f"{path!r}: {fqn!r} lies in {name!r}, which is missing from {folder!r}",
                path=path,
            )
        sizes[name] = os.path.getsize(where)
    if offset + length > sizes[name]:
        # The metadata is written last, once every shard is complete: the shard is at fault.
        where = os.path.join(folder, name)
        raise CorruptCheckpointError(
            f"{where!r} is truncated: it holds {sizes[name]} bytes, but the metadata places "
            f"{fqn!r} at bytes {offset}..{offset + length} of it",
            path=where,
        )
    return name, offset, length


def _check_cover(fqn: str, shape: tuple[int, ...], chunks: list[DcpChunk], path: str) -> None:
    """The chunks lie within the tensor, none overlaps another, and together they fill it."""
    for c in chunks:
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise _bad(path, f"{fqn!r} has a chunk of rank {len(c.sizes)} in shape {list(shape)}")
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            raise _bad(
                path,
                f"{fqn!r}'s chunk at {list(c.offsets)} of size {list(c.sizes)} lies outside its "
                f"shape {list(shape)}",
            )
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise _bad(path, f"{fqn!r}'s chunks do not add up to its shape {list(shape)}")
    # Sorted on dim 0, a chunk can overlap only those starting before it ends there.
    ordered = sorted((c for c in chunks if math.prod(c.sizes)), key=lambda c: c.offsets)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if shape and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break
            if all(
                max(ao, bo) < min(ao + asz, bo + bsz)
                for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)
            ):
                raise _bad(
                    path,
                    f"{fqn!r} has overlapping chunks at {list(a.offsets)} and {list(b.offsets)}",
                )


def _object_path(fqn: str, planner_data: Any, path: str, count: int) -> tuple[str | int, ...]:
    """Where ``fqn`` goes in the nested state dict. A list index past the number of items
    would only grow lists of Nones (DCP's set_element fills up to it), and a path deeper
    than the unpickler's nesting limit would nest past what every tree walk allows."""
    if planner_data is None:
        return (fqn,)
    where = planner_data.get(fqn)
    if (
        not isinstance(where, tuple)
        or not 0 < len(where) <= MAX_NESTING
        or not all(type(k) is str or (type(k) is int and 0 <= k < count) for k in where)
    ):
        raise _bad(path, f"planner_data places {fqn!r} at {short_repr(where, 80)}")
    return where


def load_metadata_pickle(path: str) -> Any:
    """Unpickle a DCP ``.metadata`` file through the restricted unpickler, DCP's classes
    resolved to :class:`DataStandIn` s (and ``getattr`` only as
    :class:`~ckpt_tools.formats.dcp.globals.EnumByName` allows it); nothing is checked beyond.

    Args:
        path: the ``.metadata`` file.

    Returns:
        The unpickled tree (a ``Metadata`` stand-in, if the file is one).

    Raises:
        CorruptCheckpointError: the bytes are not a valid pickle.
        UnsafeContentError: it names globals outside DCP's classes and the allowlist, or uses
            ``getattr`` other than to name a member of DCP's memory format enum.
    """
    check_regular(path)  # a FIFO of that name would block the open below
    stand_ins = dcp_metadata_stand_ins()
    try:
        with open(path, "rb") as f:
            result = load_pickle(f, MAX_METADATA_BYTES, extra_globals=stand_ins)
        if result.unsafe_globals:
            raise UnsafeContentError(
                f"{path!r} refers to globals outside DCP's metadata classes and the allowlist "
                f"({', '.join(result.unsafe_globals[:5])}); it is not read",
                globals=result.unsafe_globals,
                path=path,
            )
        stand_ins[ENUM_GETATTR].refuse_uncalled(result.root)
    except UnsafeContentError as e:
        if e.path is not None:
            raise
        raise UnsafeContentError(f"{path!r}: {e}", globals=e.globals, path=path) from e
    return result.root


def read_metadata(folder: str, metadata_file: str = ".metadata") -> DcpMetadata:
    """Read and check a DCP folder's metadata, through the restricted unpickler.

    Args:
        folder: the DCP folder.
        metadata_file: the metadata's name in it.

    Returns:
        The checked :class:`DcpMetadata`.

    Raises:
        CorruptCheckpointError: the metadata is malformed or inconsistent with the files.
        UnsupportedFormatError: it records transforms (compression) or layouts we cannot read.
        UnsafeContentError: it names globals outside DCP's classes and the allowlist.
    """
    path = os.path.join(folder, metadata_file)
    return parse_metadata(load_metadata_pickle(path), folder, path)


def parse_metadata(root: Any, folder: str, path: str) -> DcpMetadata:
    """Check the tree :func:`load_metadata_pickle` read from ``path`` in DCP folder ``folder``.

    Returns:
        The checked :class:`DcpMetadata`.

    Raises:
        CorruptCheckpointError: the metadata is malformed or inconsistent with the files.
        UnsupportedFormatError: it records transforms (compression) or layouts we cannot read.
    """
    top = _fields(root, "Metadata", path)
    entries, planner_data = top.get("state_dict_metadata"), top.get("planner_data")
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise _bad(path, "state_dict_metadata is not a dict of keys")
    if planner_data is not None and not isinstance(planner_data, dict):
        raise _bad(path, f"planner_data is {short_repr(planner_data, 60)}, not a dict")
    version = top.get("version")
    index = _storage_index(top.get("storage_data"), path)
    sizes: dict[str, int] = {}
    items: dict[str, DcpTensor | DcpBytes] = {}
    for fqn, entry in entries.items():
        where = _object_path(fqn, planner_data, path, len(entries))
        if isinstance(entry, DataStandIn) and type(entry).global_ref.name == "BytesStorageMetadata":
            _fields(entry, "BytesStorageMetadata", path)
            if (fqn, None) not in index:
                raise _bad(path, f"value {fqn!r} has no storage entry")
            items[fqn] = DcpBytes(
                fqn, where, *_location(index.pop((fqn, None)), fqn, folder, sizes, path)
            )
            continue
        fields = _fields(entry, "TensorStorageMetadata", path)
        dtype, requires_grad = _dtype(fields.get("properties"), fqn, path)
        shape = _ints(fields.get("size"), f"{fqn!r}'s size", path)
        raw_chunks = fields.get("chunks")
        if not isinstance(raw_chunks, list) or not raw_chunks:
            raise _bad(path, f"{fqn!r} has chunks {short_repr(raw_chunks, 60)}")
        chunks = []
        for raw in raw_chunks:
            c = _fields(raw, "ChunkStorageMetadata", path)
            offsets = _ints(c.get("offsets"), f"{fqn!r}'s chunk offsets", path)
            info = index.pop((fqn, offsets), None)
            if info is None:
                raise _bad(path, f"{fqn!r}'s chunk at {list(offsets)} has no storage entry")
            sizes_ = _ints(c.get("sizes"), f"{fqn!r}'s chunk sizes", path)
            chunks.append(DcpChunk(offsets, sizes_, *_location(info, fqn, folder, sizes, path)))
        _check_cover(fqn, shape, chunks, path)
        items[fqn] = DcpTensor(fqn, where, dtype, shape, requires_grad, tuple(chunks))
    if index:
        raise _bad(
            path,
            f"storage entries for unknown items ({', '.join(repr(k[0]) for k in list(index)[:3])})",
        )
    return DcpMetadata(items, version if isinstance(version, str) else None, tuple(sorted(sizes)))
