"""Paths into checkpoint trees: one meaning of ``--select model.ema`` for every caller.

``inspect``, the rewrites, ``load_state_dict``, ``diff`` and ``load_into`` all reach the state
dict through :func:`walk_path`; rewrites put the renamed one back with :func:`replace_at`, and
:func:`entries_beside` lists what a path leaves out (``inspect``'s other entries, the
non-tensor entries a safetensors output cannot hold).

A path follows mapping keys (as text, or as ints for digits), list and tuple indices, and
object attributes: an :class:`~ckpt_tools.descriptors.Opaque` stand-in's pickled state in a
tree read without torch, an object's ``__dict__`` in a tree loaded with ``trust=True``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_tools.descriptors import Opaque, RebuiltTensor, Sealed, TensorRef, short_repr
from ckpt_tools.errors import SelectError, shown

__all__ = [
    "PathWalk",
    "attributes_of",
    "entries_beside",
    "is_tensor",
    "key_text",
    "mapping_at",
    "parse_select",
    "replace_at",
    "resolve_path",
    "walk_path",
]


def is_tensor(value: Any) -> bool:
    """A tensor descriptor (a sparse, meta or nested one too), or a real torch tensor (checked
    by module: torch is not imported)."""
    return isinstance(value, (TensorRef, RebuiltTensor)) or (
        type(value).__module__.startswith("torch") and hasattr(value, "dtype")
    )


def parse_select(select: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``"a.b"`` -> ``("a", "b")``; a sequence is taken as is; None stays None."""
    if select is None:
        return None
    if isinstance(select, str):
        return tuple(part for part in select.split(".") if part) if select else ()
    return tuple(select)


class PathWalk(NamedTuple):
    """How far a path reached in an object tree.

    Attributes:
        keys: the entries followed, one per level, as text. A run of dotted parts that is
            one key stays one: ``("model.ema",)`` for ``{"model.ema": ...}``.
        nodes: the root, then the node each key led to (one more than ``keys``).
        rest: the parts not reached; empty when the whole path was found.
    """

    keys: tuple[str, ...]
    nodes: tuple[Any, ...]
    rest: tuple[str, ...] = ()

    @property
    def found(self) -> bool:
        """The whole path was followed."""
        return not self.rest

    @property
    def node(self) -> Any:
        """Where the walk stopped: the node at the path when :attr:`found`."""
        return self.nodes[-1]


_MISSING = object()


def attributes_of(node: Any) -> Mapping[str, Any] | None:
    """The attributes of an object in a tree, when a path may follow them.

    An :class:`Opaque` stand-in (a class outside the allowlist, never imported) holds them
    as its pickled state; a real object (in a tree loaded with ``trust=True``, or passed in
    memory) in its ``__dict__``. Containers, classes, tensors and ckpt_tools' descriptors
    have none to follow.

    Returns:
        The attribute mapping, or None.

    Example:
        >>> import argparse
        >>> attributes_of(argparse.Namespace(lr=0.1))
        {'lr': 0.1}
    """
    if isinstance(node, Opaque):
        return node.state if isinstance(node.state, Mapping) else None
    if isinstance(node, (Mapping, list, tuple, str, bytes, type, Sealed)) or is_tensor(node):
        return None
    attributes = getattr(node, "__dict__", None)
    return attributes if isinstance(attributes, dict) else None


def mapping_at(node: Any) -> Mapping[Any, Any] | None:
    """``node`` as a mapping: itself, or an object's attributes; None for anything else."""
    return node if isinstance(node, Mapping) else attributes_of(node)


def _key_in(node: Mapping[Any, Any], key: str) -> Any:
    # Keys come as text; unpickled mappings may use ints (``{0: sd}``).
    if key in node:
        return key
    if key.isdigit() and int(key) in node:
        return int(key)
    return _MISSING


def _child(node: Any, key: str) -> Any:
    if isinstance(node, (list, tuple)):
        return node[int(key)] if key.isdigit() and int(key) < len(node) else _MISSING
    mapping = mapping_at(node)
    if mapping is None:
        return _MISSING
    found = _key_in(mapping, key)
    return _MISSING if found is _MISSING else mapping[found]


def walk_path(root: Any, parts: Sequence[str]) -> PathWalk:
    """Follow ``parts`` from ``root`` as far as they go; never raises.

    At each level the longest run of parts that is a key wins, so ``("model", "ema")``
    finds ``{"model.ema": ...}`` as well as ``{"model": {"ema": ...}}``. Mapping keys match
    as text or, for digits, as ints; list and tuple items by index; objects by attribute
    (see :func:`attributes_of`).

    Args:
        root: the tree.
        parts: the path, split at dots.

    Returns:
        A :class:`PathWalk`; ``found`` says whether every part was reached.

    Example:
        >>> walk_path({"model.ema": {"w": 1}}, ("model", "ema", "w")).keys
        ('model.ema', 'w')
    """
    nodes, keys, i = [root], [], 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            candidate = ".".join(parts[i:j])
            child = _child(nodes[-1], candidate)
            if child is not _MISSING:
                nodes.append(child)
                keys.append(candidate)
                i = j
                break
        else:
            return PathWalk(tuple(keys), tuple(nodes), tuple(parts[i:]))
    return PathWalk(tuple(keys), tuple(nodes))


def resolve_path(root: Any, select: str | Sequence[str]) -> PathWalk:
    """The node at a dotted path (``"model.ema"``) or a tuple of keys (see :func:`walk_path`).

    Raises:
        SelectError: part of the path is missing; the message lists what is there instead.

    Example:
        >>> resolve_path({"model": [{"w": 1}]}, "model.0").node
        {'w': 1}
    """
    parts = parse_select(select) or ()
    walk = walk_path(root, parts)
    if not walk.found:
        available = [key_text(k) for k, _ in _items(walk.node)]
        # Shown: a key holding a line break must not start a line of the error of its own.
        raise SelectError(
            shown(
                f"no entry {walk.rest[0]!r} under {'.'.join(walk.keys) or 'the root'}; "
                f"it has: {', '.join(available[:12]) or 'nothing'}"
            ),
            argument="select",
            value=repr(".".join(parts)),
            flag="--select",
        )
    return walk


def key_text(key: Any) -> str:
    """A mapping key as text: strings as they are, anything else (unpickled) safely."""
    return key if isinstance(key, str) else short_repr(key, 40)


def _items(node: Any) -> list[tuple[Any, Any]]:
    if isinstance(node, (list, tuple)):
        return list(enumerate(node))
    mapping = mapping_at(node)
    return list(mapping.items()) if mapping is not None else []


def entries_beside(root: Any, path: Sequence[str]) -> list[tuple[str, Any]]:
    """What a path leaves out: the entries next to it at every level, by dotted name.

    Args:
        root: the tree.
        path: keys leading to the selected node (as :class:`Selection` has them).

    Returns:
        ``(dotted name, value)`` pairs, outermost level first.

    Raises:
        SelectError: ``path`` is not in ``root``.

    Example:
        >>> entries_beside({"model": {"sd": {}, "step": 3}, "epoch": 1}, ("model", "sd"))
        [('epoch', 1), ('model.step', 3)]
    """
    walk = resolve_path(root, tuple(path))
    beside: list[tuple[str, Any]] = []
    prefix = ""
    for node, key in zip(walk.nodes, walk.keys):
        beside += [(prefix + key_text(k), v) for k, v in _items(node) if key_text(k) != key]
        prefix += key + "."
    return beside


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
        copied[_key_in(node, key)] = child
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
