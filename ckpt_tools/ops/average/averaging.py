"""``average``: the element-wise (weighted) mean of N checkpoints, streamed, torch-free.

Each key's value is ``sum(w_i * x_i) / sum(w_i)`` over that key in every input, accumulated in
float64 (complex parts too) chunk by chunk with numpy, in input order, then cast back to its
dtype exactly as torch's ``.to`` would (:mod:`~ckpt_tools.ops.average.mean_stream`). Memory
is a few chunks, whatever N and the file sizes. Tied keys stay tied where every input ties
them alike, and are averaged and written apart where one does not
(:mod:`~ckpt_tools.ops.average.items`).

Keys are aligned as ``load_into`` aligns them: wrapper prefixes (``module.``, ``_orig_mod.``,
...) are stripped per input, so a DDP checkpoint averages with a plain one. The output is the
averaged state dict, as a plain state dict, under the first input's keys.

Integer tensors must be equal in every input, unless ``ints`` names the input to take them
from. Tensors with no mean (bool, complex32, quantized, float8 other than e4m3fn and e5m2)
and sparse, nested and meta tensors (a mean of sparse tensors whose indices differ is not a
mean of their values) are copied from the first input when every input holds the same (as
``torch.equal`` says: quantizer parameters and view bits count), and refused otherwise.
Non-tensor entries are as integer tensors: equal in every input, or taken from the input
``ints`` names. Keys of every type are kept (``7`` as well as ``"7"``); a key that is a tensor
in one input and not in another is a mismatch.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    checked_paths,
    count_of,
    str_items,
)
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import CheckpointNotFoundError, ConversionError, Remedy, UsageError
from ckpt_tools.formats import open_checkpoint, refuse_url
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.formats.missing import missing
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.ops.average.items import plan_items
from ckpt_tools.ops.average.mean_stream import checked_weights
from ckpt_tools.ops.preflight import check_key_types
from ckpt_tools.ops.rewrite.plan import format_family, output_format_for
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.ops.transform.slim import select_weights
from ckpt_tools.ops.transform.state_dict_plan import finish, plan_state_dict_output
from ckpt_tools.structure.keys import plan_renames
from ckpt_tools.structure.paths import key_text
from ckpt_tools.structure.wrappers import strip_wrapper_rules

__all__ = ["average", "pick_inputs"]


def pick_inputs(patterns: Sequence[str], last: int | None = None) -> list[str]:
    """Expand globs; with ``last``, keep the last N by the numbers in their paths, else by mtime.

    The numbers order the paths where nothing else in them differs (``ckpt_9.pt`` before
    ``ckpt_10.pt``, ``global_step200/model.pt`` before ``global_step1000/model.pt``); names
    that differ beyond their numbers (``best_7.pt`` beside ``ckpt_9.pt``) are ordered by
    modification time.

    A file named twice stays twice: :func:`average` says so, rather than averaging one file
    fewer than the user counted.

    Raises:
        CheckpointNotFoundError: a path named without a glob does not exist.
        UsageError: a URL (average reads local files), a glob that matches no file, no
            input at all, or ``last`` is below 1.

    Example:
        >>> pick_inputs(["*.pt"])
        ['ddp.pt', 'deflated.pt', 'model.pt']
    """
    if last is not None:
        count_of(last, "last", flag="--last")
    found: list[str] = []
    for pattern in patterns:
        refuse_url(pattern)  # (a URL's '?' would read as a glob, its absence as "no such file")
        # A name that exists is that file, glob characters and all (the shell already
        # expanded it, or the file is named x[1].pt): never a pattern matching another.
        if os.path.exists(pattern):
            found.append(pattern)
        elif glob.has_magic(pattern):
            matched = sorted(glob.glob(pattern))
            if not matched:  # one input fewer than the user counted: never dropped silently
                raise UsageError(f"{pattern!r} matches no file")
            found += matched
        else:  # named, not matched: before --last sorts by mtime, which would stat it
            raise missing(pattern) or CheckpointNotFoundError(repr(pattern), path=pattern)
    if last is not None:
        found = _in_run_order(found)[-last:]
    if not found:
        raise UsageError("expected at least one input")
    return found


def _in_run_order(paths: Sequence[str]) -> list[str]:
    """``paths`` oldest first: by their numbers where the paths differ in nothing else (the
    step in ``step200_bf16.pt`` or ``global_step200/mp_rank_00_model_states.pt``, wherever it
    lies), else by modification time: numbers beside different words are no one count."""
    parts = [re.split(r"(\d+)", os.path.abspath(p)) for p in paths]  # words, number, words ...
    if len({tuple(p[0::2]) for p in parts}) == 1 and len(parts[0]) > 1:
        steps = {p: tuple(int(n) for n in part[1::2]) for p, part in zip(paths, parts)}
        return sorted(paths, key=steps.__getitem__)
    return sorted(paths, key=lambda p: os.stat(p).st_mtime_ns)


def _aligned(sd: Mapping[Any, Any]) -> dict[Any, tuple[Any, Any]]:
    # Wrapper rules rename str keys only; other keys (0, (1, 2)) align as they are.
    keys = [k for k in sd if isinstance(k, str)]
    rules, _ = strip_wrapper_rules(sd, anywhere=True)  # (names to match, not to write)
    plan = plan_renames(keys, rules) if rules else {}
    return {(plan.get(k, k) if isinstance(k, str) else k): (k, v) for k, v in sd.items()}


def _mismatches(names: Sequence[str], aligned: Sequence[dict[Any, tuple[Any, Any]]]) -> list[str]:
    lines: list[str] = []
    first = aligned[0]
    for name, other in zip(names[1:], aligned[1:]):
        for key in first:
            if key not in other:
                lines.append(f"- {_named(key)} (missing in {name})")
        for key in other:
            if key not in first:
                lines.append(f"+ {_named(key)} (only in {name})")
        for key, (_, a) in first.items():
            if key not in other:
                continue
            b = other[key][1]
            kinds = (TensorRef, RebuiltTensor)
            tensors = isinstance(a, kinds), isinstance(b, kinds)
            if any(tensors) and (
                not all(tensors) or (type(a), a.shape, a.dtype) != (type(b), b.shape, b.dtype)
            ):
                lines.append(f"~ {key_text(key)}: {_kind(a)} in {names[0]}, {_kind(b)} in {name}")
    return lines


def _named(key: Any) -> str:
    """A key as a mismatch line names it: a string as it is, another key with its type (the
    int ``1`` and the string ``"1"`` read alike)."""
    return key if isinstance(key, str) else f"{type(key).__name__} key {key_text(key)}"


def _kind(value: Any) -> str:
    """A value as a mismatch line says it: a tensor's dtype and shape (and a sparse, nested
    or meta one's kind), else its type."""
    if isinstance(value, TensorRef):
        return f"{value.dtype} {list(value.shape)}"
    if isinstance(value, RebuiltTensor):
        kind = "meta" if value.device == "meta" else value.layout
        return f"{value.dtype} {list(value.shape)} {kind}"
    return f"a {type(value).__name__}, not a tensor,"


@checked_flags
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
        weights: one finite weight per input, with a finite non-zero sum (default: equal),
            used as given: ``w * x`` overflows exactly where torch's does.
        ints: ``first`` or ``last``: take integer tensors and non-tensor entries from that
            input instead of requiring them equal (bool and other tensors with no mean are
            never taken from one input: they must be equal).
        select: dotted path of the state dict in every input (automatic when None).
        output_format, drop_extras, allow_globals, force, verify, durable, dry_run, progress:
            as for :func:`~ckpt_tools.ops.transform.slim.slim`.

    Returns:
        A :class:`TransformResult`.

    Raises:
        ConversionError: keys, shapes or dtypes differ, a key is a tensor in one input
            only, integer tensors or non-tensor entries differ (without ``ints``), tensors
            with no mean differ, or a safetensors output and tensors under non-str keys
            (exit 7).
        UsageError: a URL (average reads local files), fewer than two inputs, an input given
            twice (the same file, however named), weights of the wrong length, NaN or
            infinite weights or a sum that is 0 or overflows, a bad ``ints``.

    Example:
        >>> average(["model.pt", "ddp.pt"], "avg.pt").message  # module. aligned away
        'average: wrote avg.pt (2292 -> 2292 tensor bytes)'
    """
    srcs = checked_paths(srcs, "srcs")
    allow_globals = str_items(allow_globals, "allow_globals")
    for src in srcs:  # before any message names one (a URL's password is never shown)
        refuse_url(src)
    dst = checked_path(dst, "dst")
    w = _weights(srcs, weights, ints)
    # OUT may be none of the inputs; each is checked (same file, hard link, symlink).
    target = next(iter([check_output_path(dst, s, force=force, in_place=None) for s in srcs]))
    ckpts = [open_checkpoint(s) for s in srcs]
    _check_distinct(srcs, [_files_read(c) for c in ckpts])  # a folder and its own file
    # A pickled nn.Module's state dict is recovered, as slim and extract recover it.
    taken = [select_weights(c, allow_globals, select, ema=False) for c in ckpts]
    selections = [selection for selection, _ in taken]
    aligned = [_aligned(s.state_dict) for s in selections]
    lines = _mismatches([os.path.basename(s) for s in srcs], aligned)
    if lines:
        shown = "; ".join(lines[:20]) + (f"; ... {len(lines) - 20} more" if len(lines) > 20 else "")
        raise ConversionError(f"the inputs do not match (keys, shapes, dtypes): {shown}")
    fmt = output_format_for(dst, output_format, format_family(ckpts[0]))
    check_key_types(selections[0].state_dict, (), fmt, srcs[0])
    top_level = all(not s.path and s.module is None for s in selections)
    items, rows, storages, notes = plan_items(
        ckpts, aligned, w, ints, fmt == "safetensors", top_level=top_level
    )
    plan = plan_state_dict_output(
        ckpts[0],
        "average",
        dst,
        fmt,
        selections[0],
        items,
        weights_only=True,
        drop_extras=drop_extras,
        notes=[*taken[0][1], *notes],
        overrides=storages,
    )
    plan = replace(plan, rows=tuple(rows), sources=tuple(srcs))
    return finish(plan, target, ckpts[0], verify, dry_run, durable, progress, replace=force)


def _weights(srcs: Sequence[str], weights: Sequence[float] | None, ints: str | None) -> list[float]:
    """Each input's weight, once the arguments are checked."""
    _check_distinct(srcs)
    if len(srcs) < 2:
        raise UsageError(f"average needs at least two inputs, got {len(srcs)}: {srcs!r}")
    if ints not in (None, "first", "last"):
        raise UsageError("expected first or last", argument="ints", value=repr(ints), flag="--ints")
    return checked_weights(weights, len(srcs))


def _check_distinct(srcs: Sequence[str], identities: Sequence[object] | None = None) -> None:
    """Refuse an input given twice: the same path, two names of one file, or (``identities``:
    the files each input is read from) a folder and its weight file or index.

    Averaging a file with itself is never what was meant by naming it twice (a glob that
    overlaps another, a typo); a file meant to count more gets a larger weight.
    """
    seen: dict[object, int] = {}
    for i, src in enumerate(srcs):
        first = seen.setdefault(_identity(src) if identities is None else identities[i], i)
        if first == i:
            continue
        said = (
            f"{src!r} is given twice"
            if srcs[first] == src
            else f"{srcs[first]!r} and {src!r} are the same "
            + ("file" if identities is None else "checkpoint")
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


def _identity(path: str) -> object:
    """One file however named: its device and inode (a missing one: its path, normalized)."""
    try:
        st = os.stat(path)
    except OSError:  # missing: named as given (opening it will say it is missing)
        return os.path.normpath(path)
    return (st.st_dev, st.st_ino)


def _files_read(ckpt: Checkpoint) -> frozenset[object]:
    """The files a checkpoint is read from: an HF folder's shards, else its one file."""
    if ckpt.shards:
        return frozenset(_identity(os.path.join(ckpt.path, name)) for name in ckpt.shards)
    return frozenset({_identity(ckpt.path)})
