"""Putting a node back into a checkpoint tree: :func:`replace_at` copies the containers along
a path (:func:`~ckpt_tools.structure.paths.walk_path`'s) and shares everything else, as the
rewrites need to write a renamed state dict where the old one was."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import Opaque
from ckpt_tools.structure.paths import attributes_of, key_in, resolve_path

__all__ = ["replace_at"]


def replace_at(root: Any, path: Sequence[str], value: Any) -> Any:
    """A copy of ``root`` with the node at ``path`` replaced by ``value``; ``root`` is unchanged.

    Containers along the path are copied (shallowly: their class and attributes such as an
    OrderedDict's ``_metadata`` kept); everything else is shared with ``root``. When the node
    at ``path`` is an object whose attributes :func:`select_state_dict` took as the state
    dict, the copy keeps the object's class and ``value`` becomes its attributes.

    Args:
        root: the tree (a checkpoint's ``root``).
        path: keys, as :func:`walk_path` takes them.
        value: the new node.

    Returns:
        The new root (``value`` itself, or an object holding it, when ``path`` is empty).

    Raises:
        SelectError: ``path`` is not in ``root``.

    Example:
        >>> tree = {"model": {"w": 1}, "epoch": 3}
        >>> replace_at(tree, ("model",), {"v": 1}), tree["model"]
        ({'model': {'v': 1}, 'epoch': 3}, {'w': 1})
    """
    walk = resolve_path(root, tuple(path))
    node = walk.node
    new = _with_attributes(node, value) if _takes_attributes(node, value) else value
    for parent, key in zip(reversed(walk.nodes[:-1]), reversed(walk.keys)):
        new = _with_child(parent, key, new)
    return new


def _takes_attributes(node: Any, value: Any) -> bool:
    return (
        not isinstance(node, Mapping)
        and attributes_of(node) is not None
        and isinstance(value, Mapping)
    )


def _with_child(node: Any, key: str, child: Any) -> Any:
    if isinstance(node, tuple):
        items = list(node)
        items[int(key)] = child
        return tuple(items) if type(node) is tuple else type(node)(items)
    if isinstance(node, list):
        copied_list = copy.copy(node)
        copied_list[int(key)] = child
        return copied_list
    if isinstance(node, Mapping):
        copied = copy.copy(node)
        copied[key_in(node, key)] = child
        return copied
    attributes = attributes_of(node)
    assert attributes is not None  # the walk went through them
    return _with_attributes(node, _with_child(attributes, key, child))


def _with_attributes(node: Any, attributes: Mapping[str, Any]) -> Any:
    if isinstance(node, Opaque):
        # Not copy.copy: Opaque's __setstate__ records pickle state, it is no copy protocol.
        copied = Opaque.__new__(type(node))
        vars(copied).update(vars(node))
        copied.state = attributes
        return copied
    copied = copy.copy(node)
    vars(copied).clear()
    vars(copied).update(attributes)
    return copied
