"""What ``inspect`` says of the entries that are no tensors: each value summarised safely
(an unpickled value's ``repr`` may be huge or hostile), every entry beside the state dict
listed by its dotted name."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import Opaque, RebuiltTensor, TensorRef
from ckpt_tools.structure.selection import entries_beside, key_text
from ckpt_tools.structure.tensor_walk import holding_containers

__all__ = ["describe_value", "entries_between_tensors", "entries_summary"]


def describe_value(value: Any, limit: int = 60) -> str:
    """A short, safe summary of a non-tensor value (``int 3``, ``dict (2 keys: a, b)``).

    Example:
        >>> describe_value({"a": 1, "b": 2})
        'dict (2 keys: a, b)'
    """
    if isinstance(value, TensorRef):
        return f"tensor {value.dtype} {list(value.shape)}"
    if isinstance(value, Opaque):
        return f"{value.global_ref.qualname} object (not imported)"
    if isinstance(value, type) and issubclass(value, Opaque):
        return f"{value.global_ref.qualname} (global, not imported)"
    # Only the pickle reader makes these: a safetensors file is described without it.
    from ckpt_tools.formats.pickle.standins import ConstantRef, Reduced, TorchSize

    if isinstance(value, ConstantRef):  # torch.bfloat16, as torch.load gives it back
        return value.qualname
    layout = _layout_name(value, Reduced)
    if layout is not None:  # torch.sparse_coo: torch pickles a layout as a call by its name
        return layout
    if isinstance(value, (Reduced, TorchSize)):
        return _clip(repr(value), limit)
    if isinstance(value, (bool, int, float, complex, str, bytes, bytearray, set, frozenset)):
        # Unpickled values: repr() of a shared-reference bomb or a 5,000-digit int is not safe.
        return f"{type(value).__name__} {short_repr(value, limit)}"
    if isinstance(value, Mapping):
        tensors = sum(isinstance(v, TensorRef) for v in value.values())
        keys = ", ".join(key_text(k) for k in list(value)[:4]) + (", ..." if len(value) > 4 else "")
        extra = f", {tensors} tensors" if tensors else ""
        return f"{type(value).__name__} ({len(value)} keys{extra}: {keys})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} ({len(value)} items)"
    return f"{type(value).__name__} {short_repr(value, limit)}"


def _layout_name(value: Any, reduced: type) -> str | None:
    """``torch.sparse_coo`` for the recorded call ``_get_layout('torch.sparse_coo')``."""
    if not isinstance(value, reduced) or value.func.qualname != "torch.serialization._get_layout":
        return None
    name = value.args[0] if len(value.args) == 1 else None
    return name if name in _LAYOUTS else None


# The layouts torch.save names (torch.serialization._get_layout looks them up by these).
_LAYOUTS = frozenset(
    ["torch.strided", "torch._mkldnn", "torch.jagged"]
    + [f"torch.sparse_{n}" for n in ("coo", "csr", "csc", "bsr", "bsc")]
)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def entries_summary(
    root: Any, path: Sequence[str], state_dict: Mapping[Any, Any]
) -> dict[str, str]:
    """Non-tensor entries beside the state dict and inside it, by dotted name, summarised.

    Example:
        >>> entries_summary({"sd": {"w": 1}, "epoch": 3}, ("sd",), {"w": 1})
        {'epoch': 'int 3', 'sd.w': 'int 1'}
    """
    found = list(entries_beside(root, path))
    prefix = "".join(f"{part}." for part in path)
    for key, value in state_dict.items():
        if not isinstance(value, (TensorRef, RebuiltTensor)):
            found.append((f"{prefix}{key_text(key)}", value))
    return _summarised(found)


def entries_between_tensors(root: Any) -> dict[str, str]:
    """A root that is no state dict (``torch.save((model_sd, optimizer_sd, epoch))``): each
    entry of its containers that holds no tensor, at its place as its tensors are listed at
    theirs (:func:`~ckpt_tools.structure.tensor_walk.tensors_by_place`), summarised.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> entries_between_tensors(({"w": w, "lr": 0.1}, [{"groups": []}], 5))
        {'0.lr': 'float 0.1', '1': 'list (1 items)', '2': 'int 5'}
    """
    holding = holding_containers(root)
    found: list[tuple[str, Any]] = []
    # (a stack, in the tree's order: containers nest as deep as a pickle does)
    stack: list[tuple[Any, str, bool]] = [(root, "", True)]
    while stack:
        node, path, holds = stack.pop()
        if not holds:
            found.append((path, node))
            continue
        items = []
        for key, value in _contained(node):
            if not isinstance(value, (TensorRef, RebuiltTensor)):  # (tensors are listed)
                place = f"{path}.{key}" if path else str(key)
                items.append((value, place, id(value) in holding))
        stack.extend(reversed(items))
    return _summarised(found)


def _contained(node: Any) -> list[tuple[Any, Any]]:
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    return list(node.items()) if isinstance(node, dict) else []


def _summarised(found: list[tuple[str, Any]]) -> dict[str, str]:
    entries: dict[str, str] = {}
    seen: Counter[str] = Counter()
    for name, value in found:  # one dotted name twice (a.b and a: {b}; 1 and "1"): numbered
        seen[name] += 1
        entries[name if seen[name] == 1 else f"{name} (#{seen[name]})"] = describe_value(value)
    return entries
