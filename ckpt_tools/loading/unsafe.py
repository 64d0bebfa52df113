"""What ``torch.load(weights_only=True)`` would refuse inside a state dict: the objects of
classes outside the allowlist, each by its entry path, wherever they sit (a tensor's rebuild
arguments included); and the parts of a rebuilt tensor (its new type, its attribute state)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_tools.descriptors import Opaque, TensorRef
from ckpt_tools.formats.pickle.standins import Reduced

__all__ = ["from_type", "unsafe_entries"]


def _qualname(node: Any) -> str | None:
    if isinstance(node, Opaque):
        return type(node).global_ref.qualname
    if isinstance(node, type) and issubclass(node, Opaque):
        return node.global_ref.qualname
    return None


def unsafe_entries(node: Any, path: str = "") -> list[tuple[str, str]]:
    """Every ``(entry path, global)`` outside the allowlist inside ``node``.

    Args:
        node: the selected state dict (or any part of a read tree).
        path: the entry path of ``node`` itself.

    Returns:
        The pairs in the tree's order; ``<root>`` names ``node`` itself.

    Example:
        >>> unsafe_entries({"w": 1, "cfg": {"lr": 0.1}})
        []
    """
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    # A stack, not recursion: torch.load reads a pickle however deep its containers nest.
    todo: list[tuple[Any, str, bool]] = [(node, path, False)]
    while todo:
        item, where, in_tensor = todo.pop()
        name = _qualname(item)
        if name is not None:
            found.append((where or "<root>", name))
            continue
        if id(item) in seen:
            continue
        if isinstance(item, (Mapping, list, tuple, set, frozenset)):
            seen.add(id(item))
        children = _unsafe_children(item, where)
        # What a tensor's rebuild call holds is named by the tensor's own entry path.
        in_tensor = in_tensor or isinstance(item, TensorRef)
        if in_tensor:
            children = [(child, where) for child, _ in children]
        todo.extend((c, p, in_tensor) for c, p in reversed(children))  # popped in the tree's order
    return found


def _unsafe_children(item: Any, where: str) -> list[tuple[Any, str]]:
    """What :func:`unsafe_entries` looks into below ``item``, with each child's path."""
    if isinstance(item, Mapping):
        children = [(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]
        attributes = getattr(item, "__dict__", None)  # kept alive by the mapping
        return [*children, (attributes, where)] if attributes else children
    if isinstance(item, (list, tuple, set, frozenset)):
        return [(v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(item)]
    if isinstance(item, TensorRef):
        # Every argument of the rebuild call: torch refuses a global in any of them (hooks,
        # metadata, a new type, a state, quantizer parameters) while it unpickles.
        return [(arg, where) for arg in item.args]
    if isinstance(item, Reduced):
        return [(item.args, where)]
    return []


def from_type(ref: TensorRef) -> tuple[bool, Any, Any, Any]:
    """How ``_rebuild_from_type_v2`` rebuilt ``ref``, if it did.

    Args:
        ref: a tensor descriptor.

    Returns:
        ``(is it _rebuild_from_type_v2, its new type, inner args, state)``; all but the
        first None when it is not.
    """
    if ref.func is None or ref.func.name != "_rebuild_from_type_v2" or len(ref.args) != 4:
        return False, None, None, None
    return True, ref.args[1], ref.args[2], ref.args[3]
