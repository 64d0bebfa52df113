"""Pickled ``nn.Module`` objects give up their state dict, without their classes.

``torch.save(model)`` pickles the module objects themselves: each one is its class (never
imported here: an :class:`~ckpt_tools.descriptors.Opaque` stand-in) plus its instance
``__dict__`` as BUILD state, which holds ``_parameters``, ``_buffers``,
``_non_persistent_buffers_set`` and ``_modules``. A module is recognised by that state, not by
its class name, so any subclass (``DetectionModel``, a user's ``Net``) works; a
``torch.compile`` wrapper (``OptimizedModule``), pickled as a call on the module it wraps,
holds that module under ``_orig_mod``.

:func:`recover_state_dict` walks that tree as ``nn.Module.state_dict()`` does: a module's
parameters, then its persistent buffers, then each submodule under ``name.``; ``None``
entries are skipped. Each tensor is as ``state_dict()`` gives it, detached: a parameter is
its pickled data (a plain tensor, not an ``nn.Parameter``), and nothing requires grad. Tied
parameters are the same pickled object, so they come back as the
same :class:`~ckpt_tools.descriptors.TensorRef` (one storage). Attributes outside those
dictionaries (an LSTM's ``_flat_weights`` list, which references the parameters again) are
not state and are never walked.

What cannot be reproduced without the class's code: state-dict hooks (pickled with the
module, so they are named in :attr:`RecoveredModule.caveats`, never run); a class that
overrides ``get_extra_state`` or ``_save_to_state_dict`` (its code decides, and nothing in
the pickled state shows it: its ``_extra_state`` key is missing); and the ``_metadata``
versions, a class attribute that is not pickled (the recovered mapping has none).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckpt_tools.descriptors import Opaque, TensorRef

__all__ = [
    "RecoveredModule",
    "is_pickled_module",
    "module_class_name",
    "module_globals",
    "recover_module",
]

_MODULE_DICTS = ("_parameters", "_buffers", "_modules")
_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks")


# torch.compile's wrapper pickles as a call on the module it wraps, without a state of its
# own; its state_dict() is that module's under ``_orig_mod.``.
_COMPILED = "torch._dynamo.eval_frame.OptimizedModule"


def _state(node: Any) -> Mapping[str, Any] | None:
    if not isinstance(node, Opaque):
        return None
    if isinstance(node.state, Mapping):
        return node.state
    if type(node).global_ref.qualname == _COMPILED and node.args and _state(node.args[0]):
        return {"_parameters": {}, "_buffers": {}, "_modules": {"_orig_mod": node.args[0]}}
    return None


def is_pickled_module(node: Any) -> bool:
    """True for a pickled ``nn.Module``: an unimported object whose state holds its dicts.

    Example:
        >>> import collections
        >>> m = Opaque()
        >>> m.state = {"_parameters": {}, "_buffers": {}, "_modules": {}}
        >>> is_pickled_module(m), is_pickled_module({"_parameters": {}})
        (True, False)
    """
    state = _state(node)
    return state is not None and all(isinstance(state.get(k), Mapping) for k in _MODULE_DICTS)


def module_class_name(node: Any) -> str:
    """The qualified class name a pickled object names (``ultralytics...DetectionModel``).

    ``copyreg._reconstructor(cls, base, state)`` (protocols 0 and 1) names the class in its
    first argument; ``NEWOBJ`` (protocol 2, what ``torch.save`` writes) is the class itself.
    """
    ref = type(node).global_ref
    if ref.qualname in ("copyreg._reconstructor", "copy_reg._reconstructor") and node.args:
        first = node.args[0]
        if isinstance(first, type) and issubclass(first, Opaque):
            return first.global_ref.qualname
    return ref.qualname


@dataclass(frozen=True)
class RecoveredModule:
    """A pickled module tree's state dict.

    Attributes:
        class_name: the root module's qualified class name.
        state_dict: key -> tensor (or other state entry), in ``model.state_dict()`` order.
        modules: how many module objects were walked.
        caveats: what may differ from ``model.state_dict()``, in words.
    """

    class_name: str
    state_dict: Mapping[str, Any]
    modules: int
    caveats: tuple[str, ...] = ()

    @property
    def short_name(self) -> str:
        """The class name without its module (``DetectionModel``)."""
        return self.class_name.rpartition(".")[2]

    @property
    def description(self) -> str:
        """``pickled nn.Module `Net`: state dict recovered, 4 tensors``."""
        tensors = sum(isinstance(v, TensorRef) for v in self.state_dict.values())
        return f"pickled nn.Module `{self.short_name}`: state dict recovered, {tensors} tensors"


def recover_module(node: Any) -> RecoveredModule | None:
    """The state dict of a pickled module tree, as ``model.state_dict()`` would give it.

    Args:
        node: an object of the tree read by the restricted unpickler.

    Returns:
        A :class:`RecoveredModule`, or None when ``node`` is not a pickled module.

    Example:
        >>> from ckpt_tools.descriptors import StorageRef
        >>> w = TensorRef(StorageRef("0", "float32", 4, "cpu"), 0, (2, 2), (2, 1), "float32")
        >>> lin, seq = Opaque(), Opaque()
        >>> lin.state = {"_parameters": {"weight": w, "bias": None}, "_buffers": {},
        ...              "_modules": {}}
        >>> seq.state = {"_parameters": {}, "_buffers": {}, "_modules": {"0": lin, "1": lin}}
        >>> list(recover_module(seq).state_dict)
        ['0.weight', '1.weight']
    """
    if not is_pickled_module(node):
        return None
    found: dict[str, Any] = {}
    caveats: list[str] = []
    count = [0]
    _walk(node, "", found, caveats, count, set())
    # One detached descriptor per saved one: tied parameters stay one object.
    detached: dict[int, Any] = {}
    for key, value in found.items():
        found[key] = detached.setdefault(id(value), _detached(value))
    return RecoveredModule(module_class_name(node), found, count[0], tuple(dict.fromkeys(caveats)))


def _detached(value: Any) -> Any:
    """A state entry as ``state_dict()`` gives it: ``detach()`` makes a parameter a plain
    tensor that requires no grad."""
    if not isinstance(value, TensorRef) or not (value.is_parameter or value.requires_grad):
        return value
    if value.is_parameter and value.parameter_data is not None:
        return _detached(value.parameter_data)
    return replace(value, requires_grad=False, is_parameter=False)


def _walk(
    node: Any,
    prefix: str,
    found: dict[str, Any],
    caveats: list[str],
    count: list[int],
    on_path: set[int],
) -> None:
    # A module shared under two names is listed under both, as state_dict() does; one
    # that contains itself (which torch's own state_dict() would recurse on forever) is cut.
    state = _state(node)
    if state is None or id(node) in on_path:
        return
    on_path.add(id(node))
    count[0] += 1
    non_persistent = state.get("_non_persistent_buffers_set")
    skip = set(non_persistent) if isinstance(non_persistent, (set, frozenset)) else set()
    for name, value in state["_parameters"].items():
        if value is not None:
            found[f"{prefix}{name}"] = value
    for name, value in state["_buffers"].items():
        if value is not None and name not in skip:
            found[f"{prefix}{name}"] = value
    where = prefix[:-1] or "the root module"
    if any(isinstance(state.get(h), Mapping) and state.get(h) for h in _HOOKS):
        caveats.append(f"{where} has state-dict hooks, which may change its keys; not run")
    for name, child in state["_modules"].items():
        if child is None:
            continue
        if not is_pickled_module(child):
            caveats.append(f"{prefix}{name} is not a pickled module; left out")
            continue
        _walk(child, f"{prefix}{name}.", found, caveats, count, on_path)
    on_path.discard(id(node))


def module_globals(node: Any) -> set[str]:
    """Qualified names of every unimported global inside a tree (classes, hook functions).

    A rewrite that writes only a module's recovered state dict writes none of them.
    """
    names: set[str] = set()
    seen: set[int] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (str, bytes, int, float, TensorRef)):
            continue
        seen.add(id(item))
        if isinstance(item, type) and issubclass(item, Opaque):
            names.add(item.global_ref.qualname)
        elif isinstance(item, Opaque):
            names.add(type(item).global_ref.qualname)
            stack += [item.args, item.state, item.listitems, item.dictitems]
        elif isinstance(item, Mapping):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack += list(item)
    return names
