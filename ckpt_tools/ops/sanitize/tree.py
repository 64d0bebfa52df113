"""The object-tree half of ``sanitize``: every value made plain, nothing imported or called.

Objects of classes outside the allowlist arrive as :class:`~ckpt_tools.descriptors.Opaque`
stand-ins that recorded their pickled arguments and state. Those whose shape is known become
values ``torch.load(weights_only=True)`` accepts, read from that record alone:

- numpy arrays -> tensors, from the raw bytes in their pickled state (byte order and
  Fortran order kept; new storage records); numpy scalars -> Python scalars (``struct``);
- pickled ``nn.Module`` s -> their recovered state dict (:mod:`ckpt_tools.structure.modules`);
- ``argparse.Namespace``, ``types.SimpleNamespace``, OmegaConf ``DictConfig``/``ListConfig``
  (their ``_content`` of nodes holding ``_val``) and ``collections.defaultdict`` -> dicts and
  lists; ``pathlib`` paths -> strings; enums (a class called with one plain value) -> the value.

What ``torch.load(weights_only=True)`` itself builds is kept as it is: tensors, dicts,
``OrderedDict`` s (with their attributes), ``Counter`` s, sets, tuples, ``torch.Size``, dtypes,
devices, device-mesh layouts, a jagged tensor's dynamic ranges (``_DimRange``), plain scalars.
Everything else (other objects, a lazy module's uninitialized parameters, classes used as
values) is dropped and listed with its path. The walk copies containers and keeps shared
references shared: an object the pickle holds in several places becomes the same thing in
each, and each place is listed.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckpt_tools._types import ascii_int
from ckpt_tools.descriptors import GlobalRef, Opaque, StorageRef, TensorRef
from ckpt_tools.errors import ResourceLimitError
from ckpt_tools.formats.pickle.limits import stack_room
from ckpt_tools.formats.pickle.standins import (
    MESH_LAYOUT_CLASSES,
    ConstantRef,
    DimRange,
    Reduced,
    TorchSize,
)
from ckpt_tools.io.writers.saved_tensors import plain_tensor
from ckpt_tools.io.writers.torchzip import picklable_tensors
from ckpt_tools.ops.sanitize.kinds import (
    FROZENSETS,
    NAMESPACES,
    dropped_object,
    enum_like,
    hashable,
    path_text,
    reconstructed_items,
    same_member,
    unmirrored_state,
)
from ckpt_tools.ops.sanitize.numpy_values import (
    NUMPY_FROMBUFFER,
    NUMPY_MODULES,
    empty_bytes,
    ndarray_parts,
    numpy_scalar,
)
from ckpt_tools.ops.sanitize.result import Change
from ckpt_tools.ops.scan.severity import known_danger
from ckpt_tools.structure.modules import module_class_name, module_globals, recover_module

#: b"" as a call torch's weights_only unpickler allows (``_codecs.encode("", "latin1")``).
_EMPTY_BYTES = Reduced(GlobalRef("_codecs", "encode"), ("", "latin1"))

__all__ = ["SanitizedTree", "sanitize_tree"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
_DROP = object()
_LAYOUTS = tuple(MESH_LAYOUT_CLASSES.values())
# The mappings torch.load(weights_only=True) builds: kept as they are (an OrderedDict with
# its attributes, such as a state dict's ``_metadata``).
_KEPT_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)


@dataclass(frozen=True)
class SanitizedTree:
    """What :func:`sanitize_tree` made.

    Attributes:
        root: the new tree: plain containers, values and tensors only.
        converted: every object turned into plain values.
        dropped: every value left out (dict entries removed; list and tuple items None).
        added: new storage key -> its bytes (numpy arrays become these records).
    """

    root: Any
    converted: tuple[Change, ...]
    dropped: tuple[Change, ...]
    added: Mapping[str, bytes] = field(default_factory=dict)


def sanitize_tree(root: Any, taken_keys: set[str]) -> SanitizedTree:
    """Make a checkpoint's object tree loadable by ``torch.load(weights_only=True)``.

    Args:
        root: the tree read by the restricted unpickler.
        taken_keys: storage keys (and record names under ``data/``) the source already uses.

    Returns:
        A :class:`SanitizedTree`.

    Example:
        >>> import argparse, io, pickle
        >>> from ckpt_tools.formats.pickle.unpickler import load_pickle
        >>> tree = load_pickle(io.BytesIO(pickle.dumps({"args": argparse.Namespace(lr=0.1)})))
        >>> done = sanitize_tree(tree.root, set())
        >>> done.root, str(done.converted[0])
        ({'args': {'lr': 0.1}}, 'args: argparse.Namespace -> dict')
    """
    walker = _Sanitizer(taken_keys)
    try:
        with stack_room():
            new_root = walker.value(root, "")
    except RecursionError as e:  # a tree no check_source passed: refused, never a crash
        raise ResourceLimitError(
            "the object tree nests deeper than sanitize walks; torch.load reads it, but "
            "sanitize writes trees that deep at most"
        ) from e
    if new_root is _DROP:
        new_root = None
    return SanitizedTree(new_root, tuple(walker.converted), tuple(walker.dropped), walker.added)


def _name(node: Any) -> str:
    return type(node).global_ref.qualname


class _Sanitizer:
    def __init__(self, taken_keys: set[str]) -> None:
        self.converted: list[Change] = []
        self.dropped: list[Change] = []
        self.added: dict[str, bytes] = {}
        self.memo: dict[int, Any] = {}
        # id -> (the node, its first path, its changes' span in ``dropped`` and ``converted``).
        # Held, the node keeps its id until the walk ends: no temporary (``dict(state)`` of a
        # namespace) reuses it and is answered from the memo.
        self._walked: dict[int, tuple[Any, str, tuple[int, int], tuple[int, int]]] = {}
        self._taken = taken_keys
        numbered = (n for k in taken_keys if (n := ascii_int(k)) is not None)
        self._next_key = 1 + max(numbered, default=-1)

    def value(self, node: Any, path: str) -> Any:
        # A bare storage (torch.save of t.untyped_storage()) loads with weights_only=True.
        if isinstance(node, (*_PLAIN, ConstantRef, TorchSize, DimRange, StorageRef)):
            return node
        if id(node) in self.memo:
            self._again(id(node), path)
            return self.memo[id(node)]
        start = (len(self.dropped), len(self.converted))
        if isinstance(node, TensorRef):
            made = self._tensor(node, path)
        elif isinstance(node, Reduced):
            made = node if not module_globals(node.args) else self._drop(node, path)
        elif isinstance(node, Mapping):
            made = self._mapping(node, path)
        elif isinstance(node, list):
            made = self.memo[id(node)] = []
            made += [self._item(v, _at(path, i)) for i, v in enumerate(node)]
        elif isinstance(node, tuple):
            made = tuple(self._item(v, _at(path, i)) for i, v in enumerate(node))
        elif isinstance(node, (set, frozenset)):
            made = self._set(node, path, isinstance(node, frozenset))
        elif isinstance(node, _LAYOUTS):
            made = self._layout(node, path)
        elif isinstance(node, Opaque):
            made = self._opaque(node, path)
        else:
            made = self._drop(node, path)
        self.memo[id(node)] = made
        self._walked[id(node)] = (node, path, start, (len(self.dropped), len(self.converted)))
        return made

    def _again(self, key: int, path: str) -> None:
        # The pickle memoized this object: it stands here too, and becomes here what it
        # became in its first place, so every drop and conversion found there is listed
        # under this path as well. A node still being walked is a cycle: nothing new below.
        if key not in self._walked:
            return
        _, first, (d0, c0), (d1, c1) = self._walked[key]
        self.dropped += [c.moved(first, path) for c in self.dropped[d0:d1]]
        self.converted += [c.moved(first, path) for c in self.converted[c0:c1]]

    def _item(self, node: Any, path: str) -> Any:
        made = self.value(node, path)
        return None if made is _DROP else made

    def _drop(self, node: Any, path: str) -> Any:
        if isinstance(node, type) and issubclass(node, Opaque):
            was = f"{node.global_ref.qualname} (a class)"
        elif isinstance(node, Opaque):
            was = dropped_object(_name(node))
        else:
            was = type(node).__name__
        self.dropped.append(Change(path, was, "dropped"))
        return _DROP

    def _converted(self, path: str, was: str, became: str, made: Any) -> Any:
        self.converted.append(Change(path, was, became))
        return made

    def _mapping(self, node: Mapping[Any, Any], path: str) -> Any:
        kind = type(node)
        made: Any = kind() if kind in _KEPT_MAPPINGS else {}
        self.memo[id(node)] = made
        self._entries(made, node.items(), path)
        attributes = getattr(node, "__dict__", None)
        if kind is collections.OrderedDict and attributes:
            # torch.load sets them (BUILD); pickling an OrderedDict writes them back.
            self._entries(made.__dict__, attributes.items(), path)
        elif kind is collections.Counter and attributes:
            # torch.load sets them too (a crafted BUILD), but a Counter pickles without them.
            for name in attributes:
                self.dropped.append(Change(_at(path, name), "attribute of a Counter", "dropped"))
        if kind not in _KEPT_MAPPINGS:
            return self._converted(path, f"{kind.__module__}.{kind.__qualname__}", "dict", made)
        return made

    def _entries(self, made: dict[Any, Any], items: Iterable[tuple[Any, Any]], path: str) -> None:
        """Each key and value of ``items`` made plain into ``made``; what cannot be, listed."""
        for key, value in items:
            where = _at(path, key)
            new_key = self.value(key, where)
            if new_key is _DROP:  # listed at ``where`` already, as what the key was
                continue
            if not hashable(new_key):
                self.dropped.append(Change(where, "an entry whose key cannot be kept", "dropped"))
                continue
            if new_key in made:  # a converted key equal to another (a path, its string)
                lost = "an entry whose key, made plain, equals another's"
                self.dropped.append(Change(where, lost, "dropped"))
                continue
            new_value = self.value(value, where)
            if new_value is not _DROP:
                made[new_key] = new_value

    def _set(self, node: Iterable[Any], path: str, frozen: bool) -> Any:
        made: dict[Any, Any] = {}  # each member made plain -> the member it was
        for member in node:
            v = self.value(member, path)
            if v is _DROP:
                continue
            if not hashable(v):  # a member converted to a dict or list
                was = f"a set member that became a {type(v).__name__}"
                self.dropped.append(Change(path, was, "dropped"))
            elif v not in made:
                made[v] = member
            elif not same_member(made[v], member):  # made equal to another (a path, its string)
                lost = "a set member that, made plain, equals another"
                self.dropped.append(Change(path, lost, "dropped"))
            # else one value listed twice (frozenset([1, 1]) pickled): the set holds it once
        # torch.load(weights_only=True) builds sets (builtins.set) but no frozenset.
        return self._converted(path, "frozenset", "set", set(made)) if frozen else set(made)

    def _tensor(self, t: TensorRef, path: str) -> Any:
        state = t.attributes or None
        outside = module_globals(t.args[:3] if state is not None else t.args)
        if t.func is not None and not outside:
            # Its Python attributes (t.note = ...) are values like any other: made plain.
            if state is None:
                return t
            before = (len(self.dropped), len(self.converted))
            made = self.value(state, path)
            changed = (len(self.dropped), len(self.converted)) != before
            return replace(t, args=(*t.args[:3], made)) if changed else t
        # A subclass or a hook (a global in the rebuild call), or no pickle: a plain tensor.
        plain = plain_tensor(t)
        if t.func is None:
            return plain
        for name in state or ():
            lost = "an attribute of a tensor made plain"
            self.dropped.append(Change(_at(path, name), lost, "dropped"))
        names = module_globals(t.args)
        was = f"tensor whose rebuild names {', '.join(sorted(names))} (outside the allowlist)"
        return self._converted(path, was, "tensor", plain)

    def _layout(self, node: Opaque, path: str) -> Any:
        # An allowlisted mesh layout is kept as torch.load builds it, with what it holds
        # (sizes and strides: tuples of ints, other layouts). Holding anything that would
        # change, it is dropped whole: a layout cannot be rebuilt from converted values. A
        # walk of its own, so that nothing it meets is listed or remembered here.
        probe = _Sanitizer(set(self._taken))
        probe.value((node.args, node.state), path)
        if not (probe.dropped or probe.converted):
            return node
        self.dropped.append(Change(path, f"{_name(node)} holding other objects", "dropped"))
        return _DROP

    def _opaque(self, node: Opaque, path: str) -> Any:
        name = _name(node)
        module, _, short = name.rpartition(".")
        recovered = recover_module(node)
        if recovered is not None:
            self.memo[id(node)] = made = {}
            for key, value in recovered.state_dict.items():
                kept = self.value(value, _at(path, key))
                if kept is not _DROP:
                    made[key] = kept
            notes = "".join(f"; {c}" for c in recovered.caveats)
            was = f"pickled nn.Module {name}{notes}"
            return self._converted(path, was, f"state dict ({len(made)} entries)", made)
        if (module in NUMPY_MODULES and short == "_reconstruct") or name in NUMPY_FROMBUFFER:
            return self._ndarray(node, path)
        if module in NUMPY_MODULES and short == "scalar":
            return self._scalar(node, path)
        state = node.state if isinstance(node.state, Mapping) else None
        if state is not None and "_metadata" in state and ("_content" in state or "_val" in state):
            return self._omegaconf(node, state, path)
        # A namespace pickled by protocol 0 or 1 names its class in copyreg._reconstructor.
        if (cls := module_class_name(node)) in NAMESPACES and state is not None:
            return self._converted(path, cls, "dict", self._as_dict(node, state.items(), path))
        if name in FROZENSETS and len(node.args) <= 1 and not node.has_state:
            members = node.args[0] if node.args else ()
            if isinstance(members, (list, tuple)):  # protocol 2: frozenset(list)
                return self._set(members, path, frozen=True)
        if name == "collections.defaultdict":
            made = self._as_dict(node, node.dictitems, path)
            return self._converted(path, name, "dict", made)
        if node.dictitems and not node.args and not node.listitems and not known_danger(name):
            return self._dict_subclass(node, name, path, node.dictitems)
        if (items := reconstructed_items(node)) is not None and not known_danger(cls):
            return self._dict_subclass(node, cls, path, items)
        if (text := path_text(node, module, short)) is not None:
            return self._converted(path, name, "str", text)
        if empty_bytes(node):
            # Written as torch writes b"ab" (codecs.encode): the pickler would write b"" back
            # as the call of bytes that torch.load(weights_only=True) refuses.
            return self._converted(path, f"{name}()", "bytes", _EMPTY_BYTES)
        if enum_like(node, name) and not known_danger(name):
            return self._converted(path, f"{name}({node.args[0]!r})", "its value", node.args[0])
        return self._drop(node, path)

    def _dict_subclass(
        self, node: Opaque, name: str, path: str, items: list[tuple[Any, Any]]
    ) -> Any:
        """A dict subclass (an EasyDict, a user's OrderedDict) -> a dict of its items."""
        made = self._as_dict(node, items, path)
        lost, other = unmirrored_state(node, items)
        lost_at = [_at(path, attr) for attr in lost] + ([path] if other else [])
        kinds = [f"attribute of a {name}"] * len(lost) + [f"state of a {name}"] * other
        self.dropped.extend(Change(at, was, "dropped") for at, was in zip(lost_at, kinds))
        return self._converted(path, name, "dict", made)

    def _as_dict(self, node: Opaque, items: Iterable[tuple[Any, Any]], path: str) -> dict[Any, Any]:
        """A dict of ``items`` made plain, standing for ``node`` from the start: a namespace
        or container that holds itself holds the dict."""
        made: dict[Any, Any] = {}
        self.memo[id(node)] = made
        self._entries(made, items, path)
        return made

    def _omegaconf(self, node: Opaque, state: Mapping[str, Any], path: str) -> Any:
        # OmegaConf pickles a container's __dict__: ``_content`` maps keys (or lists items)
        # to nodes; a value node's ``_val`` holds the value. None, "???" (missing) and
        # "${...}" (interpolations) are kept as they are.
        if "_val" in state:  # a value dropped here is listed here already
            return self.value(state["_val"], path)
        content = state["_content"]
        if isinstance(content, Mapping):
            made = self._as_dict(node, content.items(), path)
        elif isinstance(content, (list, tuple)):
            made = self.memo[id(node)] = []
            made += [self._item(v, _at(path, i)) for i, v in enumerate(content)]
        else:
            made = self.value(content, path)
        became = type(made).__name__ if made is not _DROP else "dropped"
        return self._converted(path, _name(node), became, made)

    def _ndarray(self, node: Opaque, path: str) -> Any:
        parts = ndarray_parts(node)
        if parts is None:
            return self._drop(node, path)
        key = self._new_key()
        self.added[key] = parts.data
        storage = StorageRef(key, parts.dtype, math.prod(parts.shape), "cpu")
        t = TensorRef(storage, 0, parts.shape, parts.stride, parts.dtype)
        made = picklable_tensors({"t": t})["t"]
        became = f"tensor {parts.dtype} {list(parts.shape)}"
        return self._converted(path, "numpy.ndarray", became, made)

    def _scalar(self, node: Opaque, path: str) -> Any:
        found = numpy_scalar(node)
        if found is None:
            return self._drop(node, path)
        torch_dtype, made = found
        return self._converted(path, f"numpy {torch_dtype} scalar", type(made).__name__, made)

    def _new_key(self) -> str:
        while str(self._next_key) in self._taken:
            self._next_key += 1
        key = str(self._next_key)
        self._taken.add(key)
        return key


def _at(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
