"""The classes a torch.distributed.checkpoint ``.metadata`` pickle names, allowed there as data.

They are never imported: each resolves to a fresh :class:`DataStandIn` subclass that records
its call arguments and BUILD state, and only while that one pickle is read
(:func:`ckpt_tools.formats.pickle.unpickler.load_pickle`'s ``extra_globals``).
"""

from __future__ import annotations

from ckpt_tools.descriptors import GlobalRef, Opaque

__all__ = ["DCP_METADATA_GLOBALS", "DataStandIn", "dcp_metadata_stand_ins"]


class DataStandIn(Opaque):
    """A class a DCP ``.metadata`` pickle names, allowed there as plain data, never imported.

    Like :class:`~ckpt_tools.descriptors.Opaque` it records the call arguments and the BUILD
    state; :mod:`ckpt_tools.formats.dcp.metadata` reads them back as fields.
    """


# The classes (and enums, and the path class of ``StorageMeta.checkpoint_id``) a DCP
# ``.metadata`` pickle names, under every module path torch has used for them (the
# TensorProperties pair moved in torch 2.3/2.4; pathlib's PosixPath is
# ``pathlib._local.PosixPath`` on Python 3.13+). Allowed only while that one pickle is read,
# never in a checkpoint's data.pkl, which torch.load(weights_only=True) refuses with them.
_DCP = "torch.distributed.checkpoint"
DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    [f"{_DCP}.metadata.{n}" for n in ("Metadata", "TensorStorageMetadata", "StorageMeta")]
    + [f"{_DCP}.metadata.{n}" for n in ("ChunkStorageMetadata", "BytesStorageMetadata")]
    + [f"{_DCP}.metadata.{n}" for n in ("TensorProperties", "_MEM_FORMAT_ENCODING")]
    + [f"{_DCP}.metadata.MetadataIndex", f"{_DCP}.filesystem._StorageInfo"]
    + [
        f"torch.distributed._shard.sharded_tensor.metadata.{n}"
        for n in ("TensorProperties", "MEM_FORMAT_ENCODING")
    ]
    + [f"pathlib.{m}{n}" for m in ("", "_local.") for n in ("PosixPath", "WindowsPath")]
)


def dcp_metadata_stand_ins() -> dict[str, type[DataStandIn]]:
    """Fresh stand-in classes for :data:`DCP_METADATA_GLOBALS`, one set per pickle read
    (so nothing one pickle does to a class is seen by the next).

    Example:
        >>> sorted(dcp_metadata_stand_ins())[0]
        'pathlib.PosixPath'
    """
    classes: dict[str, type[DataStandIn]] = {}
    for qualname in sorted(DCP_METADATA_GLOBALS):
        module, _, name = qualname.rpartition(".")
        classes[qualname] = type(name, (DataStandIn,), {"global_ref": GlobalRef(module, name)})
    return classes
