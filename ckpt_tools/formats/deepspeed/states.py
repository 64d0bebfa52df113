"""A DeepSpeed rank file read as data: the model states and the optimizer states dicts.

Each file is a torch zip archive opened by :func:`~ckpt_tools.formats.zip.torchzip.open_torch_zip`
(the restricted unpickler: no global is imported). DeepSpeed's own classes
(:data:`DEEPSPEED_GLOBALS`) come back as inert stand-ins and are read here as data:
``ZeroStageEnum(2)`` as the stage 2 (or ``getattr(ZeroStageEnum, "gradients")``, as Python
3.11.0-3.11.4 pickle it: ``builtins.getattr`` is allowed in that one form), a loss scaler's
BUILD state as a dict. An optimizer states file holds nothing else; a global outside that
set there is refused. A model states
file may carry the caller's client state (an ``argparse.Namespace``, say): its globals are
reported, never imported, and refused only inside the entries this reader uses.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools._escape import short_repr
from ckpt_tools.descriptors import Opaque, TensorRef
from ckpt_tools.errors import CorruptCheckpointError, UnsafeContentError
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.pickle.limits import tree_children
from ckpt_tools.formats.pickle.standins import is_count
from ckpt_tools.formats.zip.torch_records import refuse_big_endian
from ckpt_tools.formats.zip.torchzip import open_torch_zip

__all__ = [
    "DEEPSPEED_GLOBALS",
    "ModelStates",
    "OptimStates",
    "read_model_states",
    "read_optim_states",
]

#: DeepSpeed's classes its checkpoints pickle, read as data (never imported): the ZeRO
#: stage enum, the loss scalers, and the fragment addresses of ``param_slice_mappings``.
DEEPSPEED_GLOBALS: frozenset[str] = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
_STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
#: How Python 3.11.0-3.11.4 pickle an enum member: ``getattr(ZeroStageEnum, "gradients")``.
#: Allowed in an optimizer states file in that one form (:func:`_stage_by_name`), as the
#: stage enum's by-value form is.
ENUM_GETATTR = "builtins.getattr"
# torch.save pickles with protocol 2, which names builtins by their Python 2 module.
_GETATTR_NAMES = frozenset({ENUM_GETATTR, "__builtin__.getattr"})
_STAGE_MEMBERS = {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3}
# The model states entries this reader uses: no global may hide in them.
_MODEL_KEYS = (
    "module",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
)
# The optimizer states entries that are not the partition itself, and what they hold.
_OPTIMIZER_PARTS = {
    "base_optimizer_state": "optimizer state",
    "optimizer_state_dict": "optimizer state",
    "loss_scaler": "loss scaler",
    "param_slice_mappings": "parameter fragment map",
}


@dataclass(frozen=True)
class ModelStates:
    """A ``*_model_states.pt`` file, read.

    Attributes:
        path: the file.
        ckpt: the opened archive (where each tensor's bytes lie).
        module: the saved module state dict: 16-bit weights below ZeRO-3, placeholders at
            ZeRO-3; buffers at every stage.
        buffer_names: the persistent buffers' names.
        param_shapes: per parameter group, name -> shape, in flat order.
        frozen_shapes: name -> shape of the frozen parameters (None: not saved).
        frozen_fragments: name -> its saved fragment (the whole parameter below ZeRO-3,
            this rank's piece at ZeRO-3).
        shared: alias -> the parameter it shares.
        others: every other entry (run state, config, the client state), as saved.
    """

    path: str
    ckpt: Checkpoint
    module: Mapping[str, TensorRef]
    buffer_names: frozenset[str]
    param_shapes: tuple[dict[str, tuple[int, ...]], ...]
    frozen_shapes: dict[str, tuple[int, ...]] | None
    frozen_fragments: dict[str, TensorRef] | None
    shared: dict[str, str]
    others: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimStates:
    """A ``*_optim_states.pt`` file, read.

    Attributes:
        path: the file.
        ckpt: the opened archive.
        stage: the ZeRO stage it records (None: the bf16 optimizer, which records none).
        partition_count: the data-parallel world size of its partitions.
        flat_groups: this rank's flat partition of each group (ZeRO-3: sub-group).
        alignment_paddings: per group, each parameter's alignment padding (ZeRO 1/2, when
            recorded).
        holds: what else the file holds, in words (``optimizer state``, ``loss scaler``).
        loss_scaler: the loss scaler's recorded state, if any.
    """

    path: str
    ckpt: Checkpoint
    stage: int | None
    partition_count: int
    flat_groups: tuple[TensorRef, ...]
    alignment_paddings: tuple[tuple[int, ...], ...] | None
    holds: tuple[str, ...]
    loss_scaler: Mapping[str, Any] | None = None


def _bad(path: str, what: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path!r} is not a DeepSpeed {what} file: {why}", path=path)


def _walk(node: Any) -> Iterator[Any]:
    """Every node of a subtree, once."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack.extend(tree_children(item) or ())


def _global_of(item: Any) -> str | None:
    """The global a node stands for: a stand-in object's class, or a class kept as a value."""
    if isinstance(item, type) and issubclass(item, Opaque):
        return item.global_ref.qualname
    return type(item).global_ref.qualname if isinstance(item, Opaque) else None


def _globals_in(node: Any) -> list[str]:
    """Every global a subtree holds (stand-in objects, or classes kept as values)."""
    return list(dict.fromkeys(g for g in map(_global_of, _walk(node)) if g is not None))


def _stage_by_name(item: Any) -> int | None:
    """The stage of ``getattr(ZeroStageEnum, "<member>")``, None for any other node."""
    if not isinstance(item, Opaque) or type(item).global_ref.qualname not in _GETATTR_NAMES:
        return None
    if item.newobj or item.has_state or item.listitems or item.dictitems or len(item.args) != 2:
        return None
    enum, member = item.args
    if _global_of(enum) != _STAGE_ENUM or not isinstance(enum, type) or type(member) is not str:
        return None
    return _STAGE_MEMBERS.get(member)


def _getattr_refused(root: Any) -> bool:
    """Whether ``builtins.getattr`` appears other than as a stage enum member by name."""
    return any(
        _global_of(item) in _GETATTR_NAMES and _stage_by_name(item) is None for item in _walk(root)
    )


def _refuse(path: str, names: list[str], where: str) -> UnsafeContentError:
    return UnsafeContentError(
        f"{path!r}: {where} refers to {', '.join(names[:3])}, a global outside DeepSpeed's "
        "classes and the allowlist; it is never imported, and the file is not read",
        globals=tuple(names),
        path=path,
    )


def _open(path: str, what: str) -> tuple[Checkpoint, dict[str, Any]]:
    ckpt = open_torch_zip(path)
    refuse_big_endian(path, ckpt.byteorder, f"its {what}")
    if ckpt.format != "torch-zip" or not isinstance(ckpt.root, dict):
        raise _bad(path, what, f"it holds {short_repr(ckpt.root, 60)}, not a dict")
    return ckpt, ckpt.root


def _shape(value: Any, path: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(is_count(v) for v in value):
        raise _bad(path, "model states", f"{what} is {short_repr(value, 60)}, not a shape")
    return tuple(value)


def _names(value: Any, path: str, what: str, kinds: tuple[type, ...] = (str,)) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(type(k) is str for k in value):
        raise _bad(path, "model states", f"{what} is {short_repr(value, 60)}, not a dict")
    if not all(isinstance(v, kinds) for v in value.values()):
        raise _bad(path, "model states", f"{what} holds values other than {kinds[0].__name__}")
    return value


def read_model_states(path: str) -> ModelStates:
    """Read a ``*_model_states.pt`` file as data.

    Args:
        path: the file.

    Returns:
        The :class:`ModelStates`.

    Raises:
        CorruptCheckpointError: not a torch archive, or not DeepSpeed's model states.
        UnsafeContentError: an entry this reader uses refers to a global.

    Example:
        >>> read_model_states("model.pt")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.CorruptCheckpointError: 'model.pt' is not a DeepSpeed model states ...
    """
    ckpt, root = _open(path, "model states")
    for key in _MODEL_KEYS:
        found = _globals_in(root.get(key))
        if found:
            raise _refuse(path, found, f"its {key!r} entry")
    saved = _names(root.get("module"), path, "its 'module' entry", (object,))
    module = {k: v for k, v in saved.items() if isinstance(v, TensorRef)}
    names = root.get("buffer_names")
    if not isinstance(names, list) or not all(type(n) is str for n in names):
        raise _bad(path, "model states", f"buffer_names is {short_repr(names, 60)}")
    groups = root.get("param_shapes")
    # one dict in older DeepSpeed; none at ZeRO-0, which partitions nothing
    groups = [groups] if isinstance(groups, dict) else [] if groups is None else groups
    if not isinstance(groups, list):
        raise _bad(path, "model states", f"param_shapes is {short_repr(groups, 60)}, not a list")
    shapes = tuple(
        {k: _shape(v, path, repr(k)) for k, v in _names(g, path, "param_shapes", (tuple,)).items()}
        for g in groups
    )
    frozen = root.get("frozen_param_shapes")
    fragments = root.get("frozen_param_fragments")
    if frozen is not None:
        frozen = {
            k: _shape(v, path, repr(k))
            for k, v in _names(frozen, path, "frozen_param_shapes", (tuple,)).items()
        }
        fragments = _names(fragments, path, "frozen_param_fragments", (TensorRef,))
    shared = _names(root.get("shared_params") or {}, path, "shared_params")
    return ModelStates(
        path=path,
        ckpt=ckpt,
        module=module,
        buffer_names=frozenset(names),
        param_shapes=shapes,
        frozen_shapes=frozen,
        frozen_fragments=fragments if frozen is not None else None,
        shared=dict(shared),
        others={k: v for k, v in root.items() if k not in _MODEL_KEYS},
    )


def _stage(value: Any, path: str) -> int:
    """The ZeRO stage: ``ZeroStageEnum(n)``'s stand-in, or a plain int (older DeepSpeed)."""
    if _stage_by_name(value) is not None:
        value = _stage_by_name(value)
    elif isinstance(value, Opaque) and type(value).global_ref.qualname == _STAGE_ENUM:
        simple = not (value.newobj or value.has_state or value.listitems or value.dictitems)
        value = value.args[0] if simple and len(value.args) == 1 else None
    if type(value) is not int or not 0 <= value <= 3:
        raise _bad(path, "optimizer states", f"zero_stage is {short_repr(value, 60)}")
    return value


def _flat_groups(value: Any, path: str) -> tuple[TensorRef, ...]:
    if not isinstance(value, list) or not value:
        raise _bad(path, "optimizer states", f"its flat groups are {short_repr(value, 60)}")
    for t in value:
        if not isinstance(t, TensorRef) or len(t.shape) != 1 or not t.is_contiguous():
            raise _bad(path, "optimizer states", f"a flat group is {short_repr(t, 80)}")
        if t.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise _bad(path, "optimizer states", f"a flat group holds {t.dtype} elements")
    if len({t.dtype for t in value}) != 1:
        raise _bad(path, "optimizer states", "its flat groups differ in dtype")
    return tuple(value)


def _paddings(value: Any, path: str) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(g, list) and all(is_count(p) for p in g) for g in value
    ):
        raise _bad(path, "optimizer states", f"param_alignment_paddings is {short_repr(value)}")
    return tuple(tuple(g) for g in value)


def read_optim_states(path: str) -> OptimStates:
    """Read a ``*_optim_states.pt`` file as data.

    Args:
        path: the file.

    Returns:
        The :class:`OptimStates`.

    Raises:
        CorruptCheckpointError: not a torch archive, or not a ZeRO (or bf16 optimizer)
            partition.
        UnsafeContentError: it refers to a global outside :data:`DEEPSPEED_GLOBALS`.

    Example:
        >>> read_optim_states("model.pt")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.CorruptCheckpointError: 'model.pt' is not a DeepSpeed optimizer ...
    """
    ckpt, root = _open(path, "optimizer states")
    foreign = [g for g in ckpt.unsafe_globals if g not in DEEPSPEED_GLOBALS]
    if _GETATTR_NAMES & set(foreign) and not _getattr_refused(root):
        foreign = [g for g in foreign if g not in _GETATTR_NAMES]
    if foreign:
        raise _refuse(path, foreign, "its pickle")
    state = root.get("optimizer_state_dict")
    if not isinstance(state, dict):
        raise _bad(path, "optimizer states", "it has no optimizer_state_dict")
    if "fp32_flat_groups" in state:
        stage: int | None = _stage(state.get("zero_stage"), path)
        groups = state["fp32_flat_groups"]
    elif "single_partition_of_fp32_groups" in state:
        stage = _stage(state["zero_stage"], path) if "zero_stage" in state else None
        groups = state["single_partition_of_fp32_groups"]
    else:
        raise _bad(path, "optimizer states", "it holds no fp32 partition")
    count = state.get("partition_count")
    count = max(count) if isinstance(count, list) and count else count
    if not is_count(count) or count < 1:
        raise _bad(path, "optimizer states", f"partition_count is {short_repr(count, 60)}")
    scaler = state.get("loss_scaler")
    return OptimStates(
        path=path,
        ckpt=ckpt,
        stage=stage,
        partition_count=count,
        flat_groups=_flat_groups(groups, path),
        alignment_paddings=_paddings(state.get("param_alignment_paddings"), path),
        holds=tuple(dict.fromkeys(v for k, v in _OPTIMIZER_PARTS.items() if state.get(k))),
        loss_scaler=scaler.state if isinstance(scaler, Opaque) and scaler.has_state else None,
    )
