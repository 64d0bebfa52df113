"""``average``'s per-key plan: what value each output key gets, and which storages stay shared.

The mean is per key, as ``{k: mean(sd_i[k])}`` computed in torch would be, whatever each
input's storage layout. A storage of the first input is computed once for all its keys (and
stays shared in the output) only where every input lays out the same keys as the same views
of one storage; otherwise each key is computed from each input's own view and written apart.
``ints="last"`` takes each integer key's value from the last input's view the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ckpt_tools.descriptors import (
    Opaque,
    RebuiltTensor,
    Reduced,
    StorageRef,
    TensorRef,
)
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.tensor_bytes import check_plain_values
from ckpt_tools.io.verify.outputs import tensor_digest
from ckpt_tools.io.writers.records import Record, copy_record, tensor_bytes_record
from ckpt_tools.io.writers.saved_tensors import fresh_tensor
from ckpt_tools.ops.average.mean_stream import INTEGER_DTYPES, MEAN_DTYPES, mean_record
from ckpt_tools.ops.average.refusals import NO_MEAN, refuse_differing
from ckpt_tools.ops.transform.plan import Item, PlanRow
from ckpt_tools.structure.paths import key_text
from ckpt_tools.structure.tensor_walk import iter_listed_tensors, quantizer_params

__all__ = ["plan_items"]


def plan_items(
    ckpts: Sequence[Checkpoint],
    aligned: Sequence[dict[str, tuple[str, Any]]],
    w: Sequence[float],
    ints: str | None,
    to_safetensors: bool,
    *,
    top_level: bool = False,
) -> tuple[list[Item], list[PlanRow], dict[int, Record], list[str]]:
    """The output items, their rows, the record making each computed storage, and notes.

    Each key gets its own value: the weighted mean of that key in every input, or one
    input's value. A storage of the first input is computed once for all its keys only where
    every input lays those keys out alike (:func:`_alike`); else each key is written apart.

    Args:
        ckpts: the inputs, opened.
        aligned: per input, aligned key -> (its key there, its value); keys, shapes and
            dtypes already checked equal.
        w: the weights, from :func:`~ckpt_tools.ops.average.mean_stream.checked_weights`.
        ints: None, ``first`` or ``last``: which input integer tensors come from.
        to_safetensors: the output is safetensors, which holds a storage once only as tied
            tensors covering it whole: any other view (strided, or part of its storage) is
            computed apart, as its own tensor.
        top_level: the state dicts are the inputs' roots, so a refusal of tensors with no
            mean may name the ``slim --drop`` that leaves them out.

    Returns:
        ``(items, rows, records, notes)``: items as
        :func:`~ckpt_tools.ops.transform.state_dict_plan.plan_state_dict_output` takes them,
        one row per tensor, ``id(storage)`` -> the record that makes it, and what was decided.

    Raises:
        ConversionError: tensors without a mean (integers and non-tensor entries without
            ``ints``) differ across inputs, or a tensor to average carries a conjugate or
            negative bit.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> model = open_checkpoint("model.pt")
        >>> sd = {k: (k, v) for k, v in model.root.items()}
        >>> plan_items([model, model], [sd, sd], [1.0, 1.0], None, False)[1][0].action
        'mean of 2'
    """
    plan = _Plan(ckpts, aligned, w, to_safetensors)
    for key, (orig, t) in aligned[0].items():
        others = [a[key][1] for a in aligned]
        if isinstance(t, RebuiltTensor):
            if not _same_everywhere(ckpts, others, plan.digest):
                plan.differ("sparse, nested or meta", key, t.layout)
            plan.add(orig, t, "copy (equal)")
        elif not isinstance(t, TensorRef):
            plan.entry(key, orig, others, ints)
        elif t.dtype in MEAN_DTYPES:
            for o in others:  # the bytes are averaged as values: a view bit would be lost
                check_plain_values(key, o, "a mean")
            plan.add(orig, plan.computed(key, others, _mean_of), f"mean of {len(ckpts)}")
        elif t.dtype in INTEGER_DTYPES and ints is not None:
            if ints == "last":
                for o in (t, others[-1]):
                    check_plain_values(key, o, "taking the last input's values")
                t = plan.computed(key, others, _last_of)
            plan.add(orig, t, f"copy ({ints} input)")
        else:
            if not plan.same(others):
                plan.differ(_group(t, others), key, t.dtype)
            plan.add(orig, t, "copy (equal)")
    # slim drops top-level entries by name: a fix only where every input names them so.
    droppable = top_level and all(
        isinstance(k, str) and "," not in k and all(a[k][0] == k for a in aligned)
        for k in plan.no_mean
    )
    refuse_differing(plan.differing, plan.no_mean if droppable else None)
    return plan.items, plan.rows, plan.storages, plan.notes


class _Plan:
    """What :func:`plan_items` collects, and which storages of the first input stay shared."""

    def __init__(
        self,
        ckpts: Sequence[Checkpoint],
        aligned: Sequence[dict[str, tuple[str, Any]]],
        w: Sequence[float],
        to_safetensors: bool,
    ) -> None:
        self.ckpts, self.aligned, self.w, self.to_safetensors = ckpts, aligned, w, to_safetensors
        self.items: list[Item] = []
        self.rows: list[PlanRow] = []
        self.storages: dict[int, Record] = {}
        self.notes: list[str] = []
        self.differing: dict[str, list[str]] = {}
        self.no_mean: list[Any] = []  # the keys among them of tensors that have no mean
        self.on_storage: dict[int, list[str]] = {}
        for key, (_, t) in aligned[0].items():
            if isinstance(t, TensorRef):
                self.on_storage.setdefault(id(t.storage), []).append(key)
        self.apart: set[int] = set()  # storages whose keys are written apart
        self.digest = _Digests()

    def add(self, orig: str, value: Any, action: str) -> None:
        self.items.append((orig, orig, value))
        self.rows.append(
            PlanRow.of(orig, orig, value.dtype, value.dtype, value.nbytes, value.nbytes, action)
        )

    def differ(self, group: str, key: Any, what: str) -> None:
        self.differing.setdefault(group, []).append(f"{key_text(key)} ({what})")
        if group in NO_MEAN:
            self.no_mean.append(key)

    def same(self, values: Sequence[Any]) -> bool:
        """Whether one key's value in every input equals the first input's (:func:`_same_value`)."""
        first = self.ckpts[0]
        pairs = zip(self.ckpts[1:], values[1:])
        return all(_same_value(first, values[0], c, v, self.digest) for c, v in pairs)

    def entry(self, key: Any, orig: Any, values: Sequence[Any], ints: str | None) -> None:
        """A non-tensor entry: the same in every input, or (as integer tensors) taken from
        the input ``ints`` names; one holding tensors is taken from the first input only (the
        output's tensors are the first input's)."""
        value = values[0]
        if not self.same(values):
            holds = bool(iter_listed_tensors(values[-1]))  # only the first input's can be taken
            if ints is None or (ints == "last" and holds):
                # Not even the first input's, where it shares an averaged storage.
                if not self._refuse_averaged_storages(key, value):
                    group = "holding tensors" if holds else "non-tensor"
                    self.differ(group, key, type(value).__name__)
            else:
                value = values[-1] if ints == "last" else value
                self.notes.append(f"{key_text(key)} differs across inputs: the {ints} input's")
                self._refuse_averaged_storages(key, value)
        self.items.append((orig, orig, value))

    def _refuse_averaged_storages(self, key: Any, value: Any) -> bool:
        """An entry taken from one input whose tensor shares a storage with averaged keys: the
        storage gets the mean, which is not the value the entry is taken for. Whether so."""
        for _, t in iter_listed_tensors(value):
            shared = self.on_storage.get(id(t.storage)) if isinstance(t, TensorRef) else None
            if shared and t.dtype in MEAN_DTYPES:
                self.differ(
                    "shares", key, f"shares a storage with {', '.join(shared)}, which is averaged"
                )
                return True
        return False

    def computed(
        self, key: str, others: Sequence[TensorRef], make: Callable[..., Record]
    ) -> TensorRef:
        """The first input's tensor over a computed storage (its storage's, shared by its keys
        as in every input), or a new tensor of its own (a storage of one key).

        ``make(ckpts, parts, w, dtype, nbytes[, views])``: the record from each input's
        tensor (or storage, with the first input's tensors on it).
        """
        t = others[0]
        sid = id(t.storage)
        if sid in self.storages:  # its keys lie alike in every input: computed once, for all
            return t
        used = range(len(self.ckpts)) if make is _mean_of else (0, len(self.ckpts) - 1)
        keys = self.on_storage[sid]
        alike = sid not in self.apart and _alike(keys, [self.aligned[i] for i in used])
        # safetensors holds a storage once only as tied tensors that each cover it whole; q, k
        # and v chunked from one storage are written each as its own, as convert writes them.
        whole = not self.to_safetensors or all(self.aligned[0][k][1].covers_storage() for k in keys)
        if alike and whole:
            storages = [others[i].storage for i in used]
            views = [self.aligned[0][k][1] for k in keys]  # where its cast runs start
            self.storages[sid] = make(
                self.ckpts, storages, self.w, t.dtype, t.storage.nbytes, views
            )
            return t
        if len(keys) > 1 and sid not in self.apart and not alike:
            self.notes.append(
                f"{', '.join(keys)} share a storage in the first input but are not laid out "
                "alike in every input: each is computed and written apart"
            )
        self.apart.add(sid)
        fresh = fresh_tensor(t)
        self.storages[id(fresh.storage)] = make(self.ckpts, others, self.w, t.dtype, t.nbytes)
        return fresh


def _mean_of(
    ckpts: Sequence[Checkpoint],
    parts: Sequence[Any],
    w: Sequence[float],
    dtype: str,
    nbytes: int,
    views: Sequence[TensorRef] = (),
) -> Record:
    """The weighted mean of one tensor (or storage, holding ``views``) per input."""
    return mean_record([_bytes_of(c, p) for c, p in zip(ckpts, parts)], w, dtype, nbytes, views)


def _last_of(ckpts: Sequence[Checkpoint], parts: Sequence[Any], *_: Any) -> Record:
    """The last input's tensor (or storage) as it is."""
    return _bytes_of(ckpts[-1], parts[-1])


def _bytes_of(ckpt: Checkpoint, part: TensorRef | StorageRef) -> Record:
    """A tensor's elements in row-major order, or a storage's bytes."""
    if isinstance(part, TensorRef):
        return tensor_bytes_record(ckpt, part)
    return copy_record(ckpt, part)


def _alike(keys: Sequence[str], aligned: Sequence[dict[str, tuple[str, Any]]]) -> bool:
    """Whether ``keys`` (one storage's in the first input) lie on one storage of the same size,
    as the same views of one dtype, in every input of ``aligned``: then a computed storage
    gives each key its own value, and keeps them shared."""
    first = [aligned[0][k][1] for k in keys]
    if len({t.dtype for t in first}) != 1:
        return False
    for sd in aligned[1:]:
        tensors = [sd[k][1] for k in keys]
        if len({id(t.storage) for t in tensors}) != 1:
            return False
        if tensors[0].storage.nbytes != first[0].storage.nbytes or any(
            (a.offset, a.stride) != (b.offset, b.stride) for a, b in zip(first, tensors)
        ):
            return False
    return True


def _group(t: TensorRef, values: Sequence[TensorRef]) -> str:
    """Which refusal a differing tensor with no mean falls under."""
    if len({v.view_bits for v in values}) > 1:
        return "view bits"
    return "integer" if t.dtype in INTEGER_DTYPES else "other"


def _same_value(ca: Checkpoint, a: Any, cb: Checkpoint, b: Any, digest: _Digests) -> bool:
    """Whether two inputs' values are equal as ``torch.load`` gives them: tensors as
    ``torch.equal`` compares them (elements, view bits, quantizer parameters), containers
    item by item (keys with their types), anything else by type and ``==``.

    A value whose stored form differs is taken as differing even where torch would find the
    values equal (``0.0`` and ``-0.0`` bytes, a negative view of negated bytes): the
    caller refuses it, never copies one input's for another's.
    """
    kinds = (TensorRef, RebuiltTensor)
    if isinstance(a, kinds) or isinstance(b, kinds):
        return type(a) is type(b) and _same_tensor(ca, a, cb, b, digest)
    if isinstance(a, Opaque) or isinstance(b, Opaque):  # one class per file: compare by name
        return (
            isinstance(a, Opaque)
            and isinstance(b, Opaque)
            and type(a).global_ref == type(b).global_ref
            and _same_value(ca, _recorded(a), cb, _recorded(b), digest)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, Reduced):
        return a.func == b.func and _same_value(ca, a.args, cb, b.args, digest)
    if isinstance(a, Mapping):
        ka, kb = [(type(k), k) for k in a], [(type(k), k) for k in b]
        # A dict equals one in another order, as == says; an OrderedDict does not.
        same_keys = ka == kb or (type(a) is dict and len(ka) == len(kb) and set(ka) == set(kb))
        return same_keys and all(_same_value(ca, a[k], cb, b[k], digest) for k in a)
    if isinstance(a, (list, tuple)):
        pairs = zip(a, b)
        return len(a) == len(b) and all(_same_value(ca, x, cb, y, digest) for x, y in pairs)
    # NaN != NaN: two NaN floats are one value as far as copying the first goes
    return bool(a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def _same_tensor(ca: Checkpoint, a: Any, cb: Checkpoint, b: Any, digest: _Digests) -> bool:
    """Two tensors of one type equal as :func:`_same_value` says."""
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    if isinstance(a, RebuiltTensor):
        return a.layout == b.layout and _same_everywhere((ca, cb), (a, b), digest)
    if a.view_bits != b.view_bits or not _same_value(
        ca, quantizer_params(a), cb, quantizer_params(b), digest
    ):
        return False
    return digest(ca, a) == digest(cb, b)


class _Digests:
    """Each tensor's digest (:func:`~ckpt_tools.io.verify.outputs.tensor_digest`), read once:
    the first input's tensors are compared with every other input's."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], bytes] = {}

    def __call__(self, ckpt: Checkpoint, t: TensorRef) -> bytes:
        key = (id(ckpt), id(t))  # both live as long as the plan
        if key not in self._known:
            self._known[key] = tensor_digest(ckpt, t)
        return self._known[key]


def _recorded(obj: Opaque) -> tuple[Any, ...]:
    """What the pickle did to an object of a class not imported: it is that object."""
    return (obj.args, obj.newobj, obj.state, obj.has_state, obj.listitems, obj.dictitems)


def _same_everywhere(ckpts: Sequence[Checkpoint], tensors: Sequence[Any], digest: _Digests) -> bool:
    """Whether a sparse, nested or meta tensor is the same in every input: layout, shape and
    dtype (checked before), strides (a meta tensor's only content), and each part's shape and
    elements."""
    first = tensors[0]
    for c, t in zip(ckpts[1:], tensors[1:]):
        if not isinstance(t, RebuiltTensor) or (t.layout, t.stride, len(t.parts)) != (
            first.layout,
            first.stride,
            len(first.parts),
        ):
            return False
        for a, b in zip(first.parts, t.parts):
            if (a.dtype, a.shape) != (b.dtype, b.shape):
                return False
            if digest(ckpts[0], a) != digest(c, b):
                return False
    return True
