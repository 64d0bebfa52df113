"""Paths into checkpoint trees: one meaning of ``--select model.ema`` for every caller.

``inspect``, the rewrites, ``load_state_dict``, ``diff`` and ``load_into`` all reach the state
dict through :func:`walk_path`; rewrites put the renamed one back with
:func:`~ckpt_tools.structure.path_replace.replace_at`, and
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

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from ckpt_tools._escape import short_repr
from ckpt_tools._types import ascii_int
from ckpt_tools.descriptors import Opaque, RebuiltTensor, Sealed, TensorRef
from ckpt_tools.errors import Remedy, SelectError, UsageError, shown

__all__ = [
    "DottedSelect",
    "PathWalk",
    "attributes_of",
    "entries_beside",
    "is_tensor",
    "key_in",
    "key_text",
    "mapping_at",
    "parse_select",
    "resolve_path",
    "select_text",
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


def select_text(select: str | Sequence[str]) -> str:
    """A selection as ``--select`` takes it: a dotted string as given, keys joined by dots.

    Example:
        >>> select_text(("model", "ema")), select_text("state_dict")
        ('model.ema', 'state_dict')
    """
    return select if isinstance(select, str) else ".".join(map(str, select))


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


def key_in(node: Mapping[Any, Any], key: str) -> Any:
    """The key of ``node`` that the text ``key`` names: itself, or the int it spells (an
    unpickled mapping may use ints: ``{0: sd}``); a private sentinel where there is none."""
    if key in node:
        return key
    number = ascii_int(key)
    return number if number is not None and number in node else _MISSING


def _child(node: Any, key: str) -> Any:
    if isinstance(node, (list, tuple)):
        index = ascii_int(key)
        return node[index] if index is not None and index < len(node) else _MISSING
    mapping = mapping_at(node)
    if mapping is None:
        return _MISSING
    found = key_in(mapping, key)
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
    steps = _steps(parts)
    while i < len(parts):
        step = next(steps(nodes[-1], i), None) if dotted else None
        if not dotted and (child := _child(nodes[-1], parts[i])) is not _MISSING:
            step = (parts[i], child, i + 1)
        if step is None:
            return PathWalk(tuple(keys), tuple(nodes), tuple(parts[i:]))
        keys.append(step[0])
        nodes.append(step[1])
        i = step[2]
    return PathWalk(tuple(keys), tuple(nodes))


def _steps(parts: Sequence[str]) -> Callable[[Any, int], Iterator[tuple[str, Any, int]]]:
    """For a dotted string's parts: the keys a node holds that start at part ``i``, longest
    first, as ``(key, child, the part after it)``."""
    # Where each part starts in the dotted string: a key's length without joining it.
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part) + 1)

    def steps(node: Any, i: int) -> Iterator[tuple[str, Any, int]]:
        longest = _longest_key(node)
        # A list's index is digits, with no dot: one part.
        for j in range(i + 1 if isinstance(node, (list, tuple)) else len(parts), i, -1):
            if longest is not None and starts[j] - starts[i] - 1 > longest:
                continue  # no key that long: a deep path is not joined at every level
            key = ".".join(parts[i:j])
            child = _child(node, key)
            if child is not _MISSING:
                yield key, child, j

    return steps


def _dotted_readings(root: Any, parts: Sequence[str]) -> list[PathWalk]:
    """Whole readings of a dotted string's parts, longest runs first: up to two, reaching
    different nodes. A stack, not recursion: torch.load reads trees however deep."""
    if not parts:
        return [PathWalk((), (root,))]
    # One answer per (node, part): a pickle may share a node under many keys, and each
    # shared level would otherwise double the readings to try. Nodes are held, so that the
    # ids keying the memo stay theirs.
    memo: dict[tuple[int, int], list[PathWalk]] = {}
    held: list[Any] = [root]

    steps = _steps(parts)

    # Each frame: node, its part, its steps, its readings, the step whose readings it awaits.
    frames: list[list[Any]] = [[root, 0, steps(root, 0), [], None]]
    while frames:
        frame = frames[-1]
        node, i, pending, found, awaited = frame
        if awaited is not None:
            key, child, j = awaited
            for walk in memo[id(child), j]:
                if len(found) < 2 and all(walk.node is not f.node for f in found):
                    found.append(PathWalk((key, *walk.keys), (node, *walk.nodes)))
        frame[4] = step = next(pending, None)
        if step is None:
            memo[id(node), i] = found
            frames.pop()
            continue
        _, child, j = step
        if (id(child), j) in memo:
            continue
        held.append(child)
        if j == len(parts):
            memo[id(child), j] = [PathWalk((), (child,))]
        else:
            frames.append([child, j, steps(child, j), [], None])
    return memo[id(root), 0]


def _longest_key(node: Any) -> int | None:
    """The length of ``node``'s longest key as text, where only keys of that text match;
    None where a longer text may (an int key or a list index: ``"007"`` names ``7``)."""
    if isinstance(node, (list, tuple)):
        return None
    keys = mapping_at(node) or {}
    if not all(isinstance(k, str) for k in keys):
        return None
    return max(map(len, keys), default=0)


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
