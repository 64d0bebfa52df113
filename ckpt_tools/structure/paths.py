"""Paths into checkpoint trees: one meaning of ``--select model.ema`` for every caller.

``inspect``, the rewrites, ``load_state_dict``, ``diff`` and ``load_into`` all reach the state
dict through :func:`walk_path`; rewrites put the renamed one back with :func:`replace_at`, and
:func:`entries_beside` lists what a path leaves out (``inspect``'s other entries, the
non-tensor entries a safetensors output cannot hold).

A path follows mapping keys (as text, or as ints for digits), list and tuple indices, and
object attributes: an :class:`~ckpt_tools.descriptors.Opaque` stand-in's pickled state in a
tree read without torch, an object's ``__dict__`` in a tree loaded with ``trust=True``.

A sequence of keys (``("model", "ema")``) is followed key by key, exactly. A dotted string
(``"model.ema"``) may also mean a key that holds dots (``{"model.ema": ...}``): it is read
whichever way reaches an entry, and refused when two readings reach different entries.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import Opaque, RebuiltTensor, Sealed, TensorRef
from ckpt_tools.errors import Remedy, SelectError, UsageError, shown

__all__ = [
    "DottedSelect",
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


_MISSING = object()


class DottedSelect(tuple[str, ...]):
    """The parts of a dotted ``select`` string: a run of them may be one key that holds dots.

    A plain tuple of parts is followed exactly; this one as :func:`walk_path` reads dots.
    """

    __slots__ = ()


def parse_select(select: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``"a.b"`` -> ``DottedSelect(("a", "b"))``; a sequence of keys as is; None stays None.

    Raises:
        UsageError: ``select`` is neither text nor a sequence of text keys (a list index is
            its digits: ``("layers", "0")``).

    Example:
        >>> parse_select("model.ema"), parse_select(["model.ema"])
        (('model', 'ema'), ('model.ema',))
    """
    if select is None or isinstance(select, DottedSelect):
        return select
    if isinstance(select, str):
        return DottedSelect(part for part in select.split(".") if part)
    if not isinstance(select, Sequence) or isinstance(select, (bytes, bytearray)):
        raise UsageError(
            f"expected a dotted path or a sequence of keys, found {type(select).__name__}",
            argument="select",
            value=short_repr(select, 60),
        )
    wrong = next((part for part in select if not isinstance(part, str)), _MISSING)
    if wrong is not _MISSING:
        fixed = tuple(str(part) for part in select)
        raise UsageError(
            f"every key must be text; found {short_repr(wrong, 40)} "
            f"({type(wrong).__name__}), list items are named by their digits",
            argument="select",
            value=short_repr(select, 60),
            remedies=(Remedy("select", repr(fixed)),),
        )
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

    A sequence of keys is followed key by key. The parts of a dotted string
    (:class:`DottedSelect`) are read whichever way reaches an entry, the longest run of parts
    that is a key tried first, so ``"model.ema"`` finds ``{"model.ema": ...}`` as well as
    ``{"model": {"ema": ...}}`` (:func:`resolve_path` refuses one that finds both). Mapping
    keys match as text or, for digits, as ints; list and tuple items by index; objects by
    attribute (see :func:`attributes_of`).

    Args:
        root: the tree.
        parts: the keys, or a dotted string's parts (:func:`parse_select`).

    Returns:
        A :class:`PathWalk`; ``found`` says whether every part was reached.

    Example:
        >>> walk_path({"model.ema": {"w": 1}}, parse_select("model.ema.w")).keys
        ('model.ema', 'w')
        >>> walk_path({"model.ema": {"w": 1}}, ("model", "ema", "w")).found
        False
    """
    dotted = isinstance(parts, DottedSelect)
    if dotted:
        readings = _dotted_readings(root, parts)
        if readings:
            return readings[0]
    # Exact keys one by one; for a dotted string that reaches nothing, how far the longest
    # runs go, for the message.
    nodes, keys, i = [root], [], 0
    while i < len(parts):
        for j in range(len(parts) if dotted else i + 1, i, -1):
            key = ".".join(parts[i:j])
            child = _child(nodes[-1], key)
            if child is not _MISSING:
                nodes.append(child)
                keys.append(key)
                i = j
                break
        else:
            return PathWalk(tuple(keys), tuple(nodes), tuple(parts[i:]))
    return PathWalk(tuple(keys), tuple(nodes))


def _dotted_readings(root: Any, parts: Sequence[str]) -> list[PathWalk]:
    """Whole readings of a dotted string's parts, longest runs first: up to two, reaching
    different nodes."""
    # One answer per (node, part): a pickle may share a node under many keys, and each
    # shared level would otherwise double the readings to try.
    memo: dict[tuple[int, int], list[PathWalk]] = {}

    def readings_from(node: Any, i: int) -> list[PathWalk]:
        if i == len(parts):
            return [PathWalk((), (node,))]
        if (id(node), i) not in memo:
            found: list[PathWalk] = []
            for j in range(len(parts), i, -1):
                key = ".".join(parts[i:j])
                child = _child(node, key)
                rest = [] if child is _MISSING else readings_from(child, j)
                for walk in rest:
                    if len(found) < 2 and all(walk.node is not f.node for f in found):
                        found.append(PathWalk((key, *walk.keys), (node, *walk.nodes)))
            memo[id(node), i] = found
        return memo[id(node), i]

    return readings_from(root, 0)


def resolve_path(root: Any, select: str | Sequence[str]) -> PathWalk:
    """The node at a dotted path (``"model.ema"``) or a tuple of keys (see :func:`walk_path`).

    Raises:
        SelectError: part of the path is missing; the message lists what is there instead.
        UsageError: a dotted path reads two ways that reach different entries
            (``{"a.b": ..., "a": {"b": ...}}``); the message names the tuple for each.

    Example:
        >>> resolve_path({"model": [{"w": 1}]}, "model.0").node
        {'w': 1}
    """
    parts = parse_select(select) or ()
    readings = _dotted_readings(root, parts) if isinstance(parts, DottedSelect) else []
    if len(readings) > 1:
        raise _ambiguous(parts, readings)
    # walk_path's own first step is that reading; it walks only where none reaches the end.
    walk = readings[0] if readings else walk_path(root, parts)
    if not walk.found:
        available = [key_text(k) for k, _ in _items(walk.node)]
        # Shown: a key holding a line break must not start a line of the error of its own.
        raise SelectError(
            shown(
                f"no entry {walk.rest[0]!r} under {'.'.join(walk.keys) or 'the root'}; "
                f"it has: {', '.join(available[:12]) or 'nothing'}"
            ),
            argument="select",
            # As the caller spelled it: a dotted path as text, a sequence as a tuple.
            value=repr(".".join(parts) if isinstance(parts, DottedSelect) else tuple(parts)),
            flag="--select",
        )
    return walk


def _ambiguous(parts: Sequence[str], readings: list[PathWalk]) -> UsageError:
    def spelled(walk: PathWalk) -> str:
        return "".join(f"[{key!r}]" for key in walk.keys)

    first, second = readings
    return UsageError(
        shown(
            f"the dotted path reaches two different entries, {spelled(first)} and "
            f"{spelled(second)}; a sequence of keys names one exactly"
        ),
        argument="select",
        value=repr(".".join(parts)),
        flag="--select",
        remedies=tuple(
            Remedy("select", repr(walk.keys), text=f"for {spelled(walk)}") for walk in readings
        ),
    )


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
