"""``average``: the element-wise (weighted) mean of N checkpoints, streamed, torch-free.

Floating tensors are accumulated in float64 chunk by chunk with numpy (bf16 through its bits),
``sum(w_i * x_i) / sum(w_i)`` in input order, then cast back to each tensor's dtype exactly as
torch's ``.to`` would (:mod:`ckpt_tools.io.casting`). Memory is a few chunks, whatever N and the
file sizes. Each storage is averaged once, so tied weights are not averaged twice.

Keys are aligned as ``load_into`` aligns them: wrapper prefixes (``module.``, ``_orig_mod.``,
...) are stripped per input, so a DDP checkpoint averages with a plain one. The output is the
averaged state dict, as a plain state dict, under the first input's keys.

Sparse, nested and meta tensors are not averaged (a mean of sparse tensors whose indices
differ is not a mean of their values): each is copied from the first input when every input
holds the same bytes for it, and refused otherwise.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np

from ckpt_tools._types import OutputFormat, Progress, Select, StrPath, VerifyLevel
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import CheckpointNotFoundError, ConversionError, Remedy, UsageError
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.io.casting import CAST_SOURCES, cast_array
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.io.verify.outputs import tensor_digest
from ckpt_tools.io.writers.records import Record, copy_record
from ckpt_tools.ops.preflight import check_rewritable
from ckpt_tools.ops.rewrite.plan import output_format_for
from ckpt_tools.ops.transform.plan import PlanRow
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.ops.transform.state_dict_plan import finish, plan_state_dict_output
from ckpt_tools.structure.keys import plan_renames, strip_wrapper_rules
from ckpt_tools.structure.selection import select_state_dict

__all__ = ["average", "pick_inputs"]

_CHUNK = 1 << 20
_BITS = {"float64": np.uint64, "float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
_SIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def pick_inputs(patterns: Sequence[str], last: int | None = None) -> list[str]:
    """Expand globs; with ``last``, keep the last N by the number in their names, else by mtime.

    A file named twice stays twice: :func:`average` says so, rather than averaging one file
    fewer than the user counted.

    Raises:
        CheckpointNotFoundError: a path named without a glob does not exist.
        UsageError: nothing matches, or ``last`` is below 1.

    Example:
        >>> pick_inputs(["*.pt"])
        ['ddp.pt', 'model.pt']
    """
    if last is not None and last < 1:
        raise UsageError(
            "expected a count of 1 or more", argument="last", value=repr(last), flag="--last"
        )
    found: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            found += sorted(glob.glob(pattern))
        elif os.path.exists(pattern):
            found.append(pattern)
        else:  # named, not matched: before --last sorts by mtime, which would stat it
            raise CheckpointNotFoundError(f"no such file or folder: {pattern!r}", path=pattern)
    if last is not None:
        numbers = [re.findall(r"\d+", os.path.basename(p)) for p in found]
        if all(numbers):
            found.sort(key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[-1]))
        else:
            found.sort(key=lambda p: os.stat(p).st_mtime_ns)
        found = found[-last:]
    if not found:
        raise UsageError(f"no input matches {', '.join(map(repr, patterns))}")
    return found


def _to_f64(data: bytes, dtype: str) -> np.ndarray:
    bits = np.frombuffer(data, dtype=_BITS[dtype])
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return bits.view(
        {"float64": np.float64, "float32": np.float32, "float16": np.float16}[dtype]
    ).astype(np.float64)


def _mean_record(spans: Sequence[Any], weights: Sequence[float], dtype: str, numel: int) -> Record:
    size = _SIZE[dtype]
    total_w = float(sum(weights))

    def produce() -> Iterable[bytes]:
        fds = [os.open(s.path, os.O_RDONLY) for s in spans]
        try:
            for first in range(0, numel, _CHUNK):
                count = min(_CHUNK, numel - first)
                acc = np.zeros(count, np.float64)
                for fd, span, w in zip(fds, spans, weights):
                    data = os.pread(fd, count * size, span.offset + first * size)
                    if len(data) != count * size:
                        raise OSError(5, f"{span.path} ended early")
                    acc += _to_f64(data, dtype) * w
                acc /= total_w
                if dtype == "float64":
                    yield acc.tobytes()
                else:
                    yield cast_array(acc.view(np.uint64), "float64", dtype, first, numel).tobytes()
        finally:
            for fd in fds:
                os.close(fd)

    return Record(numel * size, produce=produce, action=f"mean of {len(spans)}")


def _aligned(sd: Mapping[Any, Any]) -> dict[str, tuple[str, Any]]:
    keys = [k for k in sd if isinstance(k, str)]
    rules, _ = strip_wrapper_rules(keys)
    plan = plan_renames(keys, rules) if rules else {k: k for k in keys}
    return {plan.get(k, k): (k, v) for k, v in sd.items() if isinstance(k, str)}


def _mismatches(names: Sequence[str], aligned: Sequence[dict[str, tuple[str, Any]]]) -> list[str]:
    lines: list[str] = []
    first = aligned[0]
    for name, other in zip(names[1:], aligned[1:]):
        for key in first:
            if key not in other:
                lines.append(f"- {key} (missing in {name})")
        for key in other:
            if key not in first:
                lines.append(f"+ {key} (only in {name})")
        for key, (_, a) in first.items():
            b = other.get(key, (None, None))[1]
            kinds = (TensorRef, RebuiltTensor)
            if (
                isinstance(a, kinds)
                and isinstance(b, kinds)
                and (type(a), a.shape, a.dtype) != (type(b), b.shape, b.dtype)
            ):
                lines.append(
                    f"~ {key}: {a.dtype} {list(a.shape)} in {names[0]}, "
                    f"{b.dtype} {list(b.shape)} in {name}"
                )
    return lines


def average(
    srcs: Sequence[StrPath],
    dst: StrPath,
    *,
    weights: Sequence[float] | None = None,
    ints: Literal["first", "last"] | None = None,
    select: Select = None,
    output_format: OutputFormat | None = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> TransformResult:
    """Average checkpoints element-wise into ``dst`` (a plain state dict).

    Args:
        srcs: two or more checkpoints (any readable format, any wrapper prefixes), each
            once: to count one more than another, give it a larger weight.
        dst: the output.
        weights: one weight per input (default: equal).
        ints: ``first`` or ``last``: take integer/bool tensors from that input instead of
            requiring them equal.
        select: dotted path of the state dict in every input (automatic when None).
        output_format, drop_extras, allow_globals, force, verify, durable, dry_run, progress:
            as for :func:`~ckpt_tools.ops.transform.slim.slim`.

    Returns:
        A :class:`TransformResult`.

    Raises:
        ConversionError: keys, shapes or dtypes differ, or integer tensors differ (exit 7).
        UsageError: fewer than two inputs, an input given twice (the same file, however
            named), weights of the wrong length, a bad ``ints``.

    Example:
        >>> average(["model.pt", "ddp.pt"], "avg.pt").message  # module. aligned away
        'average: wrote avg.pt (2292 -> 2292 tensor bytes)'
    """
    srcs = [os.fspath(p) for p in srcs]
    dst = os.fspath(dst)
    w = _weights(srcs, weights, ints)
    # OUT may be none of the inputs; each is checked (same file, hard link, symlink).
    target = next(iter([check_output_path(dst, s, force=force, in_place=None) for s in srcs]))
    ckpts = [open_checkpoint(s) for s in srcs]
    selections = [select_state_dict(c.root, select=select) for c in ckpts]
    for c, s in zip(ckpts, selections):
        check_rewritable(c, allow_globals, s.path)
    aligned = [_aligned(s.state_dict) for s in selections]
    lines = _mismatches([os.path.basename(s) for s in srcs], aligned)
    if lines:
        shown = "\n".join(lines[:20]) + (f"\n... {len(lines) - 20} more" if len(lines) > 20 else "")
        raise ConversionError(f"the inputs do not match (keys, shapes, dtypes):\n{shown}")
    items, rows, storages = _mean_items(ckpts, aligned, w, ints)
    fmt = output_format_for(dst, output_format, ckpts[0].format)
    plan = plan_state_dict_output(
        ckpts[0],
        "average",
        dst,
        fmt,
        selections[0],
        items,
        weights_only=True,
        drop_extras=drop_extras,
        overrides=storages,
    )
    plan = replace(plan, rows=tuple(rows), sources=tuple(srcs))
    return finish(plan, target, ckpts[0], verify, dry_run, durable, progress, replace=force)


def _weights(srcs: Sequence[str], weights: Sequence[float] | None, ints: str | None) -> list[float]:
    """Each input's weight, once the arguments are checked."""
    _check_distinct(srcs)
    if len(srcs) < 2:
        raise UsageError(f"average needs at least two inputs, got {len(srcs)}: {srcs!r}")
    w = [1.0] * len(srcs) if weights is None else [float(x) for x in weights]
    if len(w) != len(srcs) or sum(w) == 0:
        raise UsageError(
            f"expected {len(srcs)} weights with a non-zero sum",
            argument="weights",
            value=repr(list(weights or ())),
            flag="--weights",
        )
    if ints not in (None, "first", "last"):
        raise UsageError("expected first or last", argument="ints", value=repr(ints), flag="--ints")
    return w


def _check_distinct(srcs: Sequence[str]) -> None:
    """Refuse an input given twice: the same path, or two names of one file.

    Averaging a file with itself is never what was meant by naming it twice (a glob that
    overlaps another, a typo); a file meant to count more gets a larger weight.
    """
    seen: dict[object, int] = {}
    for i, src in enumerate(srcs):
        try:
            st = os.stat(src)
            identity: object = (st.st_dev, st.st_ino)
        except OSError:  # missing: named as given (opening it will say it is missing)
            identity = os.path.normpath(src)
        first = seen.setdefault(identity, i)
        if first == i:
            continue
        said = (
            f"{src!r} is given twice"
            if srcs[first] == src
            else f"{srcs[first]!r} and {src!r} are the same file"
        )
        raise UsageError(
            f"{said} (inputs {first + 1} and {i + 1} of {len(srcs)}); average each input once",
            path=src,
            remedies=(
                Remedy(
                    "weights", None, flag="--weights", text="to count one input more than another"
                ),
            ),
        )


def _mean_items(
    ckpts: Sequence[Checkpoint],
    aligned: Sequence[dict[str, tuple[str, Any]]],
    w: Sequence[float],
    ints: str | None,
) -> tuple[list[tuple[str, str | None, Any]], list[PlanRow], dict[int, Record]]:
    """The output items, their rows, and the record making each storage (a mean, or a copy).

    Raises:
        ConversionError: a tensor lies differently across inputs, or integer tensors differ
            and ``ints`` does not say which to take.
    """
    differing: list[str] = []
    rows: list[PlanRow] = []
    storages: dict[int, Record] = {}
    items: list[tuple[str, str | None, Any]] = []
    unequal: list[str] = []
    for key, (orig, t) in aligned[0].items():
        items.append((orig, orig, t))
        if isinstance(t, RebuiltTensor):
            others = [a[key][1] for a in aligned]
            if not _same_everywhere(ckpts, others):
                unequal.append(key)
            rows.append(PlanRow(orig, orig, t.dtype, t.dtype, t.nbytes, t.nbytes, "copy (equal)"))
            continue
        if not isinstance(t, TensorRef):
            continue
        others = [a[key][1] for a in aligned]
        if t.dtype in CAST_SOURCES:
            if id(t.storage) not in storages:
                storages[id(t.storage)] = _mean_of(key, t, ckpts, others, w)
            action = f"mean of {len(ckpts)}"
        else:
            if ints is None and len({tensor_digest(c, o) for c, o in zip(ckpts, others)}) > 1:
                differing.append(key)
            if ints == "last":  # the first input's view, the last input's bytes
                if others[-1].storage.nbytes != t.storage.nbytes:
                    raise ConversionError(f"{key!r} lies differently in its storage across inputs")
                storages[id(t.storage)] = copy_record(ckpts[-1], others[-1].storage)
            action = "copy (last input)" if ints == "last" else "copy (first input)"
        rows.append(PlanRow(orig, orig, t.dtype, t.dtype, t.nbytes, t.nbytes, action))
    if unequal:
        raise ConversionError(
            "sparse, nested and meta tensors are not averaged, and these differ across "
            f"inputs: {', '.join(unequal[:8])}",
            remedies=(
                Remedy(text="leave them out of the inputs (ckpt extract), or make them dense"),
            ),
        )
    if differing:
        raise ConversionError(
            f"integer tensors differ across inputs: {', '.join(differing[:8])}",
            remedies=(
                Remedy("ints", "'first'", flag="--ints first", text="to take the first input's"),
                Remedy("ints", "'last'", flag="--ints last", text="to take the last input's"),
            ),
        )
    return items, rows, storages


def _same_everywhere(ckpts: Sequence[Checkpoint], tensors: Sequence[Any]) -> bool:
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
            if tensor_digest(ckpts[0], a) != tensor_digest(c, b):
                return False
    return True


def _mean_of(
    key: str,
    t: TensorRef,
    ckpts: Sequence[Checkpoint],
    others: Sequence[TensorRef],
    w: Sequence[float],
) -> Record:
    """The record averaging ``t``'s storage over every input (each laid out as the first)."""
    spans = []
    for c, o in zip(ckpts, others):
        if (o.offset, o.stride, o.storage.nbytes) != (t.offset, t.stride, t.storage.nbytes):
            raise ConversionError(
                f"{key!r} lies differently in its storage across inputs; convert them first"
            )
        spans.append(c.span(o.storage))
    numel = t.storage.nbytes // _SIZE[t.dtype]
    return _mean_record(spans, w, t.dtype, numel)
