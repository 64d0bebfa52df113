"""The arguments of the torch calls a checkpoint's pickle may make, checked as torch checks them.

``torch.Size``, ``torch.device``, ``torch.serialization._get_layout`` and the sparse rebuild
are on the allowlist; their stand-ins never call torch, so each refuses every argument the real
call refuses (the fuzzer smuggled shell commands through a device string and a size, and an
unknown sparse layout). Refusing is exit 4: torch.load fails on such a file.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.errors import CorruptCheckpointError

__all__ = ["check_device", "check_layout", "check_view_metadata", "checked_size"]

# Device types torch.device parses (c10/core/Device.cpp, torch 2.13), and the largest index it
# keeps (c10::DeviceIndex is int8_t; larger ones wrap around, so they are refused).
_DEVICE_TYPES = frozenset(
    {
        *("cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve"),
        *("fpga", "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone"),
    }
)
_DEVICE = re.compile(r"([a-z]+)(?::(0|[1-9][0-9]{0,2}))?")
_MAX_DEVICE_INDEX = 127
# torch's layouts (_get_layout's cache is built from torch.layout objects), and the sparse ones
# _rebuild_sparse_tensor rebuilds (any other raises NotImplementedError there).
_SPARSE_LAYOUTS = frozenset({"sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"})
_LAYOUTS = _SPARSE_LAYOUTS | {"strided", "_mkldnn", "jagged"}


def checked_size(dims: Any) -> tuple[int, ...]:
    """``torch.Size(dims)``'s dimensions: a sequence of ints (bools count) that fit in int64.

    Example:
        >>> checked_size([2, True])
        (2, 1)
    """
    if not isinstance(dims, (tuple, list)) or not all(
        isinstance(d, int) and -(1 << 63) <= d < 1 << 63 for d in dims
    ):
        raise CorruptCheckpointError(
            f"the pickle calls torch.Size with {short_repr(dims, 40)}; torch.Size takes a "
            "sequence of integers, so torch refuses this file"
        )
    return tuple(int(d) for d in dims)


def check_device(args: tuple[Any, ...]) -> None:
    """Refuse ``torch.device(*args)`` arguments torch refuses.

    Example:
        >>> check_device(("cuda", 1))
    """
    kind, index = (*args, None)[:2]
    match = _DEVICE.fullmatch(kind) if isinstance(kind, str) else None
    parsed = int(match.group(2)) if match and match.group(2) is not None else None
    valid = (
        match is not None
        and match.group(1) in _DEVICE_TYPES
        and (parsed is None or parsed <= _MAX_DEVICE_INDEX)
        and (
            index is None
            or (type(index) is int and parsed is None and 0 <= index <= _MAX_DEVICE_INDEX)
        )
    )
    if not valid:
        shown = ", ".join(short_repr(a, 40) for a in args)
        raise CorruptCheckpointError(
            f"the pickle calls torch.device({shown}), which torch refuses; a device is a "
            "type such as 'cpu' or 'cuda' with an optional index from 0 to 127"
        )


def check_layout(name: Any, sparse: bool = False, shown: Any = None) -> None:
    """Refuse a layout name (``"torch.sparse_coo"``) torch does not have, or is not sparse.

    Example:
        >>> check_layout("torch.sparse_csr", sparse=True)
    """
    known = _SPARSE_LAYOUTS if sparse else _LAYOUTS
    if not (isinstance(name, str) and name.startswith("torch.") and name[6:] in known):
        what = "sparse tensor of layout" if sparse else "layout"
        raise CorruptCheckpointError(
            f"the pickle rebuilds a {what} {short_repr(name if shown is None else shown, 40)}, "
            "which torch does not have"
        )


def check_view_metadata(func: str, metadata: Any, dtype: str) -> None:
    """The rebuild's ``metadata`` (view bits): what torch.save writes, or refused.

    torch ignores a false value, fails on any other non-dict ("expected dict") and on a
    conjugate bit of a real tensor, and sets a bit for each key present whatever its value;
    this reader reads only what torch.save writes, ``{"conj": True}`` and ``{"neg": True}``.

    Args:
        func: the rebuild function's qualified name, for the message.
        metadata: the argument as unpickled.
        dtype: the tensor's dtype.

    Raises:
        CorruptCheckpointError: anything else.

    Example:
        >>> check_view_metadata("torch._utils._rebuild_tensor_v2", {"neg": True}, "float32")
    """
    if not metadata:
        return
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(
            f"the pickle calls {func} with metadata {short_repr(metadata, 40)}; "
            "torch.load fails on it too (the metadata must be a dict)"
        )
    if "conj" in metadata and not dtype.startswith("complex"):
        raise CorruptCheckpointError(
            f"the pickle calls {func} with a conjugate bit on a {dtype} tensor; "
            "torch.load fails on it too (only complex tensors have one)"
        )
    if any(k not in ("conj", "neg") or v is not True for k, v in metadata.items()):
        raise CorruptCheckpointError(
            f"the pickle calls {func} with metadata {short_repr(metadata, 60)}; "
            "this reader reads only the view bits torch.save writes ({'conj': True}, "
            "{'neg': True})"
        )
