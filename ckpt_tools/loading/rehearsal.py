"""torch's own verdict on a state dict, taken without touching the model: :func:`rehearse`.

``nn.Module.load_state_dict`` runs each module's compatibility code while it loads: overrides of
``_load_from_state_dict`` (BatchNorm fills ``num_batches_tracked`` in state dicts older than its
version 2), load-state-dict pre-hooks (``parametrizations.weight_norm`` renames the old
``weight_g``/``weight_v``), and the module versions a torch-saved state dict carries in
``_metadata``. Comparing key names sees none of that, so the load is rehearsed: torch itself loads
a meta view of the state dict (shapes and dtypes, no data) into a shadow of the model, a deep copy
whose parameters and buffers are meta tensors of the same shapes (the module tree and its hooks
are copied, no weight is), with ``assign=True``. Its missing and unexpected keys, shape mismatches
and other errors are torch's own.

Where the keys already match by name, shape and kind, that comparison is the verdict: the modules'
loading code reconciles differences, and a model (DDP, FSDP, a compiled one, a large one) is not
copied for nothing. Where the rehearsal cannot run (the model does not deep-copy, a hook needs
real values), the comparison by name stands, and the verdict says why.

The hooks run on the shadow, which their module argument (or ``self``) is. A hook that reaches
the model some other way, through a closure or a global, would act on the model itself.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from ckpt_tools.formats.log import logger
from ckpt_tools.loading.extras import require_torch
from ckpt_tools.loading.results import ShapeMismatch

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Verdict", "own_loading_code", "rehearse", "skipping", "with_own_metadata"]


#: How ``nn.Module.load_state_dict`` opens the error that gathers its modules' messages; any
#: other exception out of the rehearsal came from a hook.
_TORCH_REFUSAL = "Error(s) in loading state_dict for "
# Dtypes torch's copy_ has no kernel for: the bit-packed ones from or to another dtype
# (float4 into float32), the sub-byte integers at all (torch 2.13).
_NO_CAST = frozenset({"float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"})
_NO_COPY = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8))


@dataclass(frozen=True)
class Verdict:
    """What ``model.load_state_dict(sd, strict=True)`` would decide, found without loading.

    Attributes:
        missing: model keys torch would report missing.
        unexpected: state dict keys torch would report unexpected.
        shape_mismatches: keys torch would refuse for their shape (named as torch sees them,
            after the modules' hooks).
        dtype_casts: ``(key, checkpoint dtype, model dtype)`` of the keys a copy would cast.
        errors: torch's other messages (a value that is not a tensor, a copy that failed).
        fallback: why the keys were compared by name instead; None when torch decided.
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    shape_mismatches: tuple[ShapeMismatch, ...]
    dtype_casts: tuple[tuple[str, str, str], ...]
    errors: tuple[str, ...] = ()
    fallback: str | None = None


@dataclass(frozen=True)
class _Seen:
    """A key as a module's own loading code met it: after its hooks, before its copy."""

    module: nn.Module
    name: str
    have: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype


def rehearse(model: nn.Module, sd: Mapping[str, Any], *, assign: bool = False) -> Verdict:
    """torch's verdict on loading ``sd`` into ``model``, from a meta shadow of the model.

    The shadow takes every value by ``assign``; a load that copies also fails on values
    ``copy_`` cannot take (meta, sparse, nested or quantized into a plain tensor), which
    are found by name and added to the verdict's errors.

    Args:
        model: the module to load into; it is read, never changed.
        sd: the state dict, with its ``_metadata`` if it has one (the module versions).
        assign: the load will assign the values rather than copy them.

    Returns:
        A :class:`Verdict`: the comparison by name where it finds nothing to reconcile, else
        torch's, or (with ``fallback`` saying why) the comparison by name.

    Raises:
        MissingExtraError: torch is not installed.

    Example:
        >>> import torch
        >>> old = {k: v for k, v in torch.nn.BatchNorm1d(4).state_dict().items()
        ...        if k != "num_batches_tracked"}  # as saved before BatchNorm's version 2
        >>> v = rehearse(torch.nn.BatchNorm1d(4), old)
        >>> v.missing, v.fallback
        ((), None)
    """
    named, uncopyable = _by_name(model, sd)
    verdict = _torch_verdict(model, sd, named)
    if assign or not uncopyable:
        return verdict
    return replace(verdict, errors=verdict.errors + uncopyable)


def _torch_verdict(model: nn.Module, sd: Mapping[str, Any], named: Verdict) -> Verdict:
    """The comparison by name where it finds nothing to reconcile, else torch's verdict on
    the shadow (or the comparison by name, saying why the shadow could not load)."""
    torch = require_torch("load_into")
    if not (named.missing or named.unexpected or named.shape_mismatches or named.errors):
        return named
    try:
        shadow, view = _shadow(model, torch), _meta_view(sd, torch)
    except Exception as e:  # whatever stops the copy, the names can still be compared
        return _fallback(named, f"the model could not be copied onto the meta device ({e!r})")
    seen: dict[str, _Seen] = {}
    lists: dict[str, list[str]] = {}
    for module in shadow.modules():  # last in line: after the module's own hooks
        module.register_load_state_dict_pre_hook(partial(_record, torch, seen, lists))
    try:
        with warnings.catch_warnings():  # the hooks' warnings are the real load's to give
            warnings.simplefilter("ignore")
            result = shadow.load_state_dict(view, strict=False, assign=True)
        missing, unexpected, errors = result.missing_keys, result.unexpected_keys, []
    except Exception as e:
        if not (isinstance(e, RuntimeError) and str(e).startswith(_TORCH_REFUSAL) and lists):
            return _fallback(named, f"a module's loading code failed on meta tensors ({e!r})")
        missing, unexpected, errors = lists["missing"], lists["unexpected"], lists["errors"]
    return _verdict(seen, missing, unexpected, errors)


def _record(
    torch: Any,
    seen: dict[str, _Seen],
    lists: dict[str, list[str]],
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    local_metadata: Mapping[str, Any],
    strict: bool,
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> None:
    """Pre-hook on every shadow module: what torch is about to copy, and its running lists."""
    lists.update(missing=missing, unexpected=unexpected, errors=errors)
    for name, have in _own_state(module):
        value = state_dict.get(prefix + name)
        if isinstance(value, torch.Tensor) and not torch.nn.parameter.is_lazy(have):
            seen[prefix + name] = _Seen(module, name, have, tuple(value.shape), value.dtype)


def _own_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and persistent buffers ``_load_from_state_dict`` loads into ``module``."""
    buffers = [
        (k, v) for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set
    ]
    return [(k, v) for k, v in [*module._parameters.items(), *buffers] if v is not None]


def _verdict(
    seen: Mapping[str, _Seen],
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> Verdict:
    from ckpt_tools.loading.tensor_io import dtype_name

    shapes, casts = [], []
    for key, s in seen.items():
        now = dict(_own_state(s.module)).get(s.name)
        # torch left the twin in place (an assign replaces it) and the shapes differ: refused.
        if now is s.have and tuple(s.have.shape) != s.shape:
            shapes.append(ShapeMismatch(key, s.shape, tuple(s.have.shape)))
        elif s.dtype != s.have.dtype:
            casts.append((key, dtype_name(s.dtype), dtype_name(s.have.dtype)))
    # The shape refusals are in ``shapes`` already; keep the messages about anything else.
    sized = tuple(f"size mismatch for {m.key}:" for m in shapes)
    return Verdict(
        missing=tuple(missing),
        unexpected=tuple(unexpected),
        shape_mismatches=tuple(shapes),
        dtype_casts=tuple(casts),
        errors=tuple(m for m in errors if not m.startswith(sized)),
    )


def _meta_twin(tensor: torch.Tensor, torch: Any) -> torch.Tensor:
    if torch.nn.parameter.is_lazy(tensor):  # no shape until loaded: materialized on meta
        return type(tensor)(requires_grad=tensor.requires_grad, device="meta", dtype=tensor.dtype)
    twin = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        twin = torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
    return twin


def _shadow(model: nn.Module, torch: Any) -> nn.Module:
    """A deep copy of ``model`` whose tensors (parameters, buffers, tensor attributes) are meta
    twins: one twin per tensor, so tied parameters stay tied; no weight is copied."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        held = (*module._parameters.values(), *module._buffers.values(), *vars(module).values())
        for t in held:
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = _meta_twin(t, torch)
    return copy.deepcopy(model, memo)


def _meta_view(sd: Mapping[str, Any], torch: Any) -> OrderedDict[str, Any]:
    view = OrderedDict(
        (k, torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v)
        for k, v in sd.items()
    )
    return with_own_metadata(view, sd)


def with_own_metadata(out: Any, sd: Mapping[str, Any]) -> Any:
    """``out`` given a copy of ``sd``'s ``_metadata`` (the module versions), if it has one.

    ``load_state_dict(assign=True)`` writes ``assign_to_params_buffers`` into the dicts it finds
    there, and a later load of the same state dict would then assign where it should copy.

    Args:
        out: the mapping handed to ``load_state_dict`` (an ``OrderedDict``).
        sd: the state dict whose ``_metadata`` it carries.

    Returns:
        ``out``.

    Example:
        >>> from collections import OrderedDict
        >>> sd = OrderedDict(w=1)
        >>> sd._metadata = {"": {"version": 1}}
        >>> own = with_own_metadata(OrderedDict(sd), sd)
        >>> own._metadata == sd._metadata, own._metadata[""] is sd._metadata[""]
        (True, False)
    """
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None:
        out._metadata = copy.deepcopy(metadata)
    return out


def _by_name(model: nn.Module, sd: Mapping[str, Any]) -> tuple[Verdict, tuple[str, ...]]:
    """The keys compared by name (torch's per-module loading code is not consulted), and
    the values a copy into the model's tensors would fail on."""
    torch = require_torch("load_into")
    from ckpt_tools.loading.tensor_io import dtype_name

    target = model.state_dict()
    own_code = own_loading_code(model, torch)
    shapes, casts, errors, uncopyable = [], [], [], []
    for key, value in sd.items():
        have = target.get(key)
        if isinstance(have, torch.Tensor) and not isinstance(value, torch.Tensor):
            errors.append(
                f"{key}: the model holds a tensor, the state dict a {type(value).__name__}"
            )
        if not (isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor)):
            continue
        if torch.nn.parameter.is_lazy(have):  # takes the shape and dtype it is loaded with
            continue
        if value.shape != have.shape:
            shapes.append(ShapeMismatch(key, tuple(value.shape), tuple(have.shape)))
        elif value.dtype != have.dtype:
            casts.append((key, dtype_name(value.dtype), dtype_name(have.dtype)))
        kind = _uncopyable_kind(value, have)
        # A module's own loading code may turn the value into one it takes (to_dense()).
        if kind and not any(key.startswith(prefix) for prefix in own_code):
            uncopyable.append(
                f'While copying the parameter named "{key}": copy_ takes no {kind} tensor into '
                "the model's"
            )
    verdict = Verdict(
        missing=tuple(k for k in target if k not in sd),
        unexpected=tuple(k for k in sd if k not in target),
        shape_mismatches=tuple(shapes),
        dtype_casts=tuple(casts),
        errors=tuple(errors),
    )
    return verdict, tuple(uncopyable)


def own_loading_code(model: nn.Module, torch: Any) -> tuple[str, ...]:
    """The key prefixes of the modules with loading code of their own (a load-state-dict
    pre-hook, or an override of ``_load_from_state_dict``): what they are given may not be
    what they copy, and they may keep it.

    Args:
        model: the model.
        torch: the torch module (imported by the caller).

    Returns:
        Prefixes such as ``"1."`` (``""`` for the root): a key starting with one is theirs.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.BatchNorm1d(1))
        >>> own_loading_code(net, torch)
        ('1.',)
    """
    plain = torch.nn.Module._load_from_state_dict
    return tuple(
        f"{name}." if name else ""
        for name, module in model.named_modules()
        if module._load_state_dict_pre_hooks or type(module)._load_from_state_dict is not plain
    )


def _uncopyable_kind(value: torch.Tensor, have: torch.Tensor) -> str:
    """What makes ``have.copy_(value)`` fail (torch's load copies each value so), or ``""``:
    a meta value has no data, and a plain tensor takes no other layout nor quantized values."""
    if value.is_meta and not have.is_meta:
        return "meta"
    if value.is_nested and not have.is_nested:
        return "nested"
    if value.layout != have.layout:
        return str(value.layout).removeprefix("torch.")
    if value.is_quantized and not have.is_quantized:
        return "quantized"
    from ckpt_tools.loading.tensor_io import dtype_name

    v, h = dtype_name(value.dtype), dtype_name(have.dtype)
    if {v, h} & _NO_COPY or (v != h and {v, h} & _NO_CAST):
        return v if v == h else f"{v} (to {h})"
    return ""


def _fallback(named: Verdict, why: str) -> Verdict:
    """The comparison by name as the verdict, where torch's could not be taken."""
    logger.warning("keys compared by name, without the modules' own loading code: %s", why)
    return replace(named, fallback=why)


def _drop(
    skip: frozenset[str], module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any
) -> None:
    for name, _have in _own_state(module):
        if prefix + name in skip:
            state_dict.pop(prefix + name, None)


@contextmanager
def skipping(model: nn.Module, keys: frozenset[str]) -> Iterator[None]:
    """While inside, ``model.load_state_dict`` leaves ``keys`` out (torch then reports them
    missing): each is dropped by its own module, after that module's hooks have named it.

    Args:
        model: the module about to load.
        keys: state dict keys as the owning modules see them (``head.weight``).

    Yields:
        Nothing; the temporary hooks are removed on the way out.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> with skipping(net, frozenset({"bias"})):
        ...     net.load_state_dict({"weight": torch.eye(2), "bias": torch.ones(5)}, strict=False)
        _IncompatibleKeys(missing_keys=['bias'], unexpected_keys=[])
    """
    owners = {key.rpartition(".")[0] for key in keys}
    modules = {
        id(m): m for path, m in model.named_modules(remove_duplicate=False) if path in owners
    }
    hook = partial(_drop, keys)
    handles = [m.register_load_state_dict_pre_hook(hook) for m in modules.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
