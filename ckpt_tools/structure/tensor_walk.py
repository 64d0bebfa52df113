"""Walks of an unpickled tree that find its tensors, with dotted paths: every dense tensor,
every tensor torch.load would give (sparse, meta and nested ones as they stand), or every
tensor whose storage a torch file holds (their parts). Iterative: torch.load reads a pickle
however deep its containers nest."""

from __future__ import annotations

from typing import Any

from ckpt_tools.descriptors import Opaque, RebuiltTensor, TensorRef
from ckpt_tools.structure.paths import key_text

__all__ = [
    "holding_containers",
    "iter_listed_tensors",
    "iter_stored_tensors",
    "iter_tensors",
    "quantizer_params",
    "quantizer_tensors",
    "storage_views",
    "stored_views",
    "tensors_by_place",
]


def stored_views(value: Any) -> tuple[TensorRef, ...]:
    """The views of storages that ``value``'s bytes lie in: a dense tensor itself, a sparse,
    nested or jagged tensor's parts, nothing for a meta tensor or a value that is no tensor.

    The one place that decides which storages hold a listed tensor, so a writer, a cast and a
    verification copy, cast and check the same records.

    Args:
        value: a :class:`TensorRef`, a :class:`RebuiltTensor`, or any other unpickled value.

    Returns:
        The views, in the order of ``value``'s parts.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> stored_views(w) == (w,), stored_views("epoch")
        (True, ())
    """
    if isinstance(value, TensorRef):
        return (value,)
    return value.parts if isinstance(value, RebuiltTensor) else ()


def iter_tensors(obj: Any, prefix: str = "") -> list[tuple[str, TensorRef]]:
    """Every tensor in a container tree, with dotted paths (``optimizer.state.0.exp_avg``).

    Args:
        obj: a tree of dicts, lists, tuples, :class:`Opaque` objects and tensors.
        prefix: path of ``obj`` itself.

    Returns:
        ``(path, tensor)`` pairs in the tree's order; a tensor reached twice is listed twice.
    """
    return _tree_tensors(obj, prefix, TensorRef)


def iter_listed_tensors(obj: Any, prefix: str = "") -> list[tuple[str, TensorRef | RebuiltTensor]]:
    """As :func:`iter_tensors`, with the tensors torch rebuilds by a call (sparse, meta,
    nested: :class:`RebuiltTensor`) where they stand: every tensor torch.load would give."""
    return _tree_tensors(obj, prefix, (TensorRef, RebuiltTensor))


def tensors_by_place(root: Any) -> dict[str, TensorRef | RebuiltTensor]:
    """The tensors of a root that is no state dict (``torch.save(tensor)``, a list of them),
    by their places in it (:func:`iter_listed_tensors`), the root itself as ``<root>``.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> list(tensors_by_place(w)), list(tensors_by_place([w, {"b": w}]))
        (['<root>'], ['0', '1.b'])
    """
    return {path or "<root>": t for path, t in iter_listed_tensors(root)}


def _tree_tensors(obj: Any, prefix: str, kinds: Any) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    # A stack, not recursion: torch.load reads a pickle however deep its containers nest.
    stack: list[tuple[Any, str]] = [(obj, prefix)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, kinds):
            found.append((path, node))
            continue
        if id(node) in seen:
            continue
        children = _children(node)
        if children is not None:
            seen.add(id(node))
            named = [(c, path if k is _HERE else _at(path, k)) for c, k in children]
            stack.extend(reversed(named))  # popped in the tree's order
    return found


# The key of a child that stands at its parent's own path (an object's state, the
# attributes torch's BUILD set on an OrderedDict).
_HERE = object()


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """The values a walk goes on to from ``node``, each with its key (:data:`_HERE` for one
    at ``node``'s own path); None for a leaf. Keys, not paths: a walk that needs no names
    builds none."""
    if isinstance(node, dict):
        children = list(zip(node.values(), node.keys()))
        # An OrderedDict's attributes (torch's BUILD sets them): a writer keeps them.
        attributes = getattr(node, "__dict__", None)
        return [*children, (attributes, _HERE)] if attributes else children
    if isinstance(node, (list, tuple)):
        return [(v, i) for i, v in enumerate(node)]
    if isinstance(node, Opaque):  # an object's state, and a dict or list subclass's items
        items = [(v, k) for k, v in node.dictitems or ()]
        listed = [(v, i) for i, v in enumerate(node.listitems or ())]
        return [(node.state, _HERE), *items, *listed]
    return None


def _at(path: str, key: Any) -> str:
    """``path.key``, a key that is no string as :func:`~ckpt_tools.structure.paths.key_text`
    writes it (an int of 5000 digits has no str())."""
    text = key_text(key)
    return f"{path}.{text}" if path else text


def holding_containers(root: Any) -> set[int]:
    """The ``id`` of every container in ``root`` (itself included) that holds a tensor
    :func:`iter_listed_tensors` lists, however deep: found by identity in one pass, so a
    deep tree costs what its size costs, not its depth times its paths' lengths.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> inner, other = [w], {"lr": 0.1}
        >>> held = holding_containers({"a": inner, "b": other})
        >>> id(inner) in held, id(other) in held
        (True, False)
    """
    kinds = (TensorRef, RebuiltTensor)
    holders: set[int] = set()
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        children = _children(node)
        if children is None:
            continue
        if expanded:  # its children are done (a cycle's back edge counts as done)
            if any(isinstance(c, kinds) or id(c) in holders for c, _ in children):
                holders.add(id(node))
        elif id(node) not in seen:
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c, _ in children)
    return holders


def quantizer_params(t: TensorRef) -> Any:
    """A quantized tensor's quantizer parameters as saved: ``(qscheme, scale, zero_point)``
    or ``(qscheme, scales, zero_points, axis)``; None for any other tensor.

    Args:
        t: a tensor (a quantized Parameter's quantizer is its data's).

    Returns:
        The parameters, or None.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> quantizer_params(w) is None
        True
    """
    if t.parameter_data is not None:
        return quantizer_params(t.parameter_data)
    name = t.func.name if t.func is not None else ""
    # _rebuild_qtensor(storage, offset, size, stride, qparams, requires_grad, hooks)
    return t.args[4] if name == "_rebuild_qtensor" and len(t.args) >= 5 else None


def quantizer_tensors(t: TensorRef) -> tuple[TensorRef, ...]:
    """The tensors of a per-channel quantized tensor's quantizer: its scales and zero points,
    saved as storages of their own; nothing for any other tensor.

    Args:
        t: a tensor (a quantized Parameter's quantizer is its data's).

    Returns:
        The quantizer's tensors, scales first.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> quantizer_tensors(w)
        ()
    """
    params = quantizer_params(t)
    # Per-channel parameters hold tensors; per-tensor ones hold numbers only.
    return tuple(v for v in params if isinstance(v, TensorRef)) if isinstance(params, tuple) else ()


def iter_stored_tensors(
    obj: Any, prefix: str = "", *, attributes: bool = False
) -> list[tuple[str, TensorRef]]:
    """Every tensor whose storage a torch file holds for ``obj``: as
    :func:`iter_tensors`, with each sparse or nested tensor's parts
    (``coo.0``, ``coo.1``) and each per-channel quantized tensor's scales and zero points
    (``q.scales``, ``q.zero_points``), so every storage a writer must copy.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 2, "cpu"), 0, (2,), (1,), "float32")
        >>> [path for path, _ in iter_stored_tensors({"w": w})]
        ['w']
    """
    found: list[tuple[str, TensorRef]] = []
    # With ``attributes``, a tensor's Python attributes (``t.mask = tensor``) too, which a
    # tree written as it is pickles with it (sanitize's); a cast drops them, as .half() does.
    seen: set[int] = set()
    trees: list[tuple[Any, str]] = [(obj, prefix)]
    while trees:
        tree, base = trees.pop()
        for path, t in iter_listed_tensors(tree, base):
            if isinstance(t, RebuiltTensor):
                found.extend((f"{path}.{i}", part) for i, part in enumerate(t.parts))
                continue
            found.append((path, t))
            quantizer = zip(("scales", "zero_points"), quantizer_tensors(t))
            found.extend((f"{path}.{name}", q) for name, q in quantizer)
            if attributes and t.attributes and id(t) not in seen:
                seen.add(id(t))
                trees.append((t.attributes, path))
    return found


def storage_views(obj: Any) -> dict[int, list[TensorRef]]:
    """Each storage a torch file holds for ``obj`` (by ``id``), in the order it is first met,
    with the tensors on it (:func:`iter_stored_tensors`' order).

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> s = StorageRef("0", "float32", 4, "cpu")
        >>> a, b = TensorRef(s, 0, (2,), (1,), "float32"), TensorRef(s, 2, (2,), (1,), "float32")
        >>> [len(ts) for ts in storage_views({"a": a, "b": b}).values()]
        [2]
    """
    views: dict[int, list[TensorRef]] = {}
    for _, t in iter_stored_tensors(obj):
        views.setdefault(id(t.storage), []).append(t)
    return views
