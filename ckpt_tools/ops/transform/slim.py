"""``slim``: cast a checkpoint's weights, drop entries, keep the weights or the EMA copy only.

Casts are computed with numpy (:mod:`ckpt_tools.io.casting`, bitwise equal to torch's
``.to(dtype)``), one storage at a time, streamed through the one writer; torch is never imported.

Only the selected state dict's floating-point tensors (float64/32/16, bfloat16) are cast.
Integer, bool, quantized, complex and float8 tensors, and every tensor outside the state dict
(optimizer state, ...), are copied bit for bit. A storage is cast once, for every tensor on it
(tied weights stay tied, views stay views over the cast storage); a storage also used by a
tensor that is not cast (another dtype, a ``keep_dtype`` key, an optimizer entry) is copied
as it is, and the plan's notes say so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    one_of,
    str_items,
)
from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import Remedy, SelectError, UsageError
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.io.remote.checkpoint import opened
from ckpt_tools.io.writers.saved_tensors import saved_tensor
from ckpt_tools.ops.preflight import check_key_types, check_rewritable, check_state_dict_output
from ckpt_tools.ops.rewrite.plan import format_family, output_format_for
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.ops.transform.state_dict_plan import finish, plan_state_dict_output
from ckpt_tools.structure.keys import compile_pattern
from ckpt_tools.structure.paths import key_text
from ckpt_tools.structure.selection import Selection, is_state_dict, select_state_dict

__all__ = ["DTYPE_NAMES", "EMA_KEYS", "cast_target", "select_weights", "slim", "take_module"]

#: ``dtype`` spellings slim accepts, and the dtype each names.
DTYPE_NAMES: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
#: Top-level entries holding an EMA copy (timm, common trainers), looked for in this order;
#: then Lightning callbacks' state whose name contains "ema".
EMA_KEYS: tuple[str, ...] = (
    "state_dict_ema",
    "model_ema",
    "ema",
    "ema_state_dict",
    "model_ema_state_dict",
    "ema_model",
)


def _select_ema(root: Any) -> tuple[Selection, str]:
    """The EMA copy's state dict, and where it was found, in words."""
    if isinstance(root, Mapping):
        for key in EMA_KEYS:
            if key in root:
                try:
                    found = select_state_dict(root, select=(key,))
                except SelectError:
                    continue
                inner = select_state_dict(found.state_dict)  # {"module": ...} wrappers
                if inner.path:
                    found = select_state_dict(root, select=(key, *inner.path))
                if found.module is None and not is_state_dict(found.state_dict):
                    continue  # the EMA's settings ({"decay": ...}), not its weights
                return found, f"took the EMA copy {'.'.join(found.path)!r}"
        callbacks = root.get("callbacks")
        if isinstance(callbacks, Mapping):
            for name, state in callbacks.items():
                if "ema" in str(name).lower() and isinstance(state, Mapping):
                    inner = select_state_dict(state)
                    if inner.state_dict:
                        path = ("callbacks", str(name), *inner.path)
                        return select_state_dict(
                            root, select=path
                        ), f"took Lightning callback {name!r}'s EMA state"
    keys = list(root)[:10] if isinstance(root, Mapping) else []
    names = ", ".join(repr(k) for k in keys) if keys else type(root).__name__
    raise SelectError(
        f"no EMA copy found: looked for {', '.join(EMA_KEYS)} and Lightning EMA callbacks; "
        f"the checkpoint has {names}",
        argument="ema",
        flag="--ema",
        remedies=(Remedy("select", "'PATH'", flag="--select PATH", text="to name the copy"),),
    )


def take_module(
    ckpt: Any, allow_globals: Sequence[str], selection: Selection
) -> tuple[Selection, list[str]]:
    """A pickled ``nn.Module`` 's recovered state dict, as ``model.state_dict()`` gives it.

    Its class cannot be written back without its code, so the output is that state dict
    alone, a plain one: parameters become plain tensors (``requires_grad`` False), each on
    its own storage as saved (tied weights stay tied); no module class is written.

    Returns:
        The selection with the plain state dict, and notes saying what was taken.

    Raises:
        UnsafeContentError: globals outside the allowlist other than module classes (exit 3).
    """
    module = selection.module
    assert module is not None
    skipped = check_state_dict_output(ckpt, allow_globals, selection.state_dict)
    plain = {
        k: saved_tensor(
            TensorRef(v.storage, v.offset, v.shape, v.stride, v.dtype), v.storage, v.dtype
        )
        if isinstance(v, TensorRef) and v.func is not None
        else v
        for k, v in selection.state_dict.items()
    }
    where = ".".join(selection.path) or "the root"
    notes = [
        f"{where!r} is a {module.description}; written as a plain state dict"
        + (f" (module classes not written: {', '.join(skipped[:4])})" if skipped else "")
    ]
    return replace(selection, state_dict=plain), notes + list(module.caveats)


def select_weights(
    ckpt: Any, allow_globals: Sequence[str], select: Select, ema: bool, *, whole: bool = False
) -> tuple[Selection, list[str]]:
    """The state dict ``slim`` and ``extract`` write: the EMA copy or the selected one.

    Args:
        ckpt: the opened checkpoint.
        allow_globals: globals allowed beyond the allowlist.
        select: the state dict's path (``None``: found as ``select_state_dict`` finds it).
        ema: take the EMA copy (``EMA_KEYS``, Lightning EMA callbacks) when no ``select``.
        whole: the output pickles the whole tree (``slim`` without ``weights_only``), not
            the state dict alone.

    Returns:
        The selection (a pickled module's as :func:`take_module` recovers it; its
        ``module`` stays set) and notes saying what was taken.

    Raises:
        SelectError: ``select`` names nothing, or ``ema`` finds no EMA copy.
        UnsafeContentError: globals outside the allowlist (exit 3).
    """
    notes: list[str] = []
    if ema and select is None:
        selection, why = _select_ema(ckpt.root)
        notes.append(why)
    else:
        selection = select_state_dict(ckpt.root, select=select)
    if selection.module is not None:
        selection, more = take_module(ckpt, allow_globals, selection)
        notes += more
    else:
        check_rewritable(ckpt, allow_globals, selection.path, whole=whole)
    return selection, notes


@checked_flags
def slim(
    src: StrPath,
    dst: StrPath,
    *,
    dtype: str | None = None,
    keep_dtype: Sequence[str] = (),
    drop: Sequence[str] = (),
    weights_only: bool = False,
    ema: bool = False,
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
    """Make a checkpoint smaller: cast weights, drop entries, keep only the (EMA) weights.

    Args:
        src: the input checkpoint.
        dst: the output (``.pt`` or ``.safetensors``; ``output_format`` overrides the suffix).
        dtype: ``bf16``/``bfloat16``, ``fp16``/``float16``/``half`` or
            ``fp32``/``float32``/``float``: cast the state dict's floating tensors to it.
        keep_dtype: regexes; matching keys keep their dtype (``norm``, ``running_var``).
        drop: top-level entries to leave out (``optimizer``, ``scheduler``).
        weights_only: write the selected state dict alone, as a plain state dict.
        ema: select the EMA copy (``state_dict_ema``, ``model_ema``, ``ema``, Lightning EMA
            callbacks); refused when there is none. A pickled ``nn.Module`` there
            (Ultralytics' ``ema``) gives up its recovered state dict, written as a plain
            state dict (as with ``weights_only``); the notes say so.
        select: dotted path of the state dict (overrides the automatic choice and ``ema``).
        output_format: ``torch`` or ``safetensors``; from ``dst``'s suffix when None, and
            refused where the suffix says otherwise.
        drop_extras: a safetensors output leaves out non-tensor entries (listed in the
            result's ``dropped``) instead of refusing them.
        allow_globals: globals outside the allowlist to carry through.
        force: replace an existing ``dst`` (never the input).
        verify: ``sizes`` (default: read the output back, keys, dtypes, shapes, sizes),
            ``full`` (also every byte, each record computed or read again) or ``none``.
        durable: fsync the output before naming it (default); False skips it, as ``cp``
            does (see :func:`~ckpt_tools.io.atomic.atomic_output`).
        dry_run: plan and check everything (refusals included), write nothing: the
            result's ``planned`` lists the file and its tensors.
        progress: called with ``(done_bytes, total_bytes)`` as tensor bytes are written
            (:data:`~ckpt_tools._types.Progress`).

    Returns:
        A :class:`TransformResult` (sizes per category before and after, what was cast,
        kept and dropped).

    Raises:
        UsageError: an unknown dtype, a ``drop`` name the checkpoint lacks, a bad regex, an
            ``output_format`` the name of ``dst`` contradicts; ``drop``, ``keep_dtype`` or
            ``allow_globals`` not a str or a sequence of str (one str is one item).
        SelectError: ``ema`` and no EMA copy.
        NonTensorEntriesError: a safetensors output, non-tensor entries (in the state dict,
            or beside it without ``weights_only``) and not ``drop_extras`` (exit 7).
        ConversionError: a safetensors output, and tensors under keys that are not str
            (keys keep their type: ``1`` and ``"1"`` are two keys) (exit 7).

    Example:
        >>> r = slim("model.pt", "small.safetensors", dtype="bf16", keep_dtype=["bn"])
        >>> r.written, r.cast[:2], "bn.weight" in r.kept
        (('small.safetensors',), ('conv.weight', 'conv.bias'), True)
    """
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    allow_globals, drop = str_items(allow_globals, "allow_globals"), str_items(drop, "drop")
    cast_to = cast_target(dtype)
    keep = _patterns(str_items(keep_dtype, "keep_dtype"))
    target = check_output_path(dst, src, force=force, in_place=None)
    with opened(src) as ckpt:
        fmt = output_format_for(dst, output_format, format_family(ckpt))
        whole = not weights_only and fmt != "safetensors"
        selection, notes = select_weights(ckpt, allow_globals, select, ema, whole=whole)
        # A module's class is not written back: only its weights can be.
        weights_only = weights_only or selection.module is not None
        root_out, dropped, keys = _drop_entries(ckpt.root, drop, selection.path)
        # Keys keep their type (``torch.load`` gives back ``1`` and ``"1"`` as two keys).
        check_key_types(selection.state_dict, (), fmt, src)
        # A root state dict is written from its items: what was dropped leaves them too.
        gone = keys if not selection.path else []
        items = [(k, k, v) for k, v in selection.state_dict.items() if k not in gone]
        plan = plan_state_dict_output(
            ckpt,
            "slim",
            dst,
            fmt,
            selection,
            items,
            weights_only=weights_only,
            drop_extras=drop_extras,
            root_out=root_out,
            cast_to=cast_to,
            keep=keep,
            dropped_entries=dropped,
            notes=notes,
        )
        return finish(plan, target, ckpt, verify, dry_run, durable, progress, replace=force)


def cast_target(dtype: str | None) -> str | None:
    """The dtype a ``dtype`` option names (any spelling of :data:`DTYPE_NAMES`), or None.

    Raises:
        UsageError: not one of those spellings.

    Example:
        >>> cast_target("half"), cast_target(None)
        ('float16', None)
    """
    if dtype is None:
        return None
    return DTYPE_NAMES[one_of(dtype, tuple(DTYPE_NAMES), "dtype", flag="--dtype")]


def _patterns(regexes: Sequence[str]) -> list[re.Pattern[str]]:
    return [compile_pattern(r, argument="keep_dtype", flag="--keep-dtype") for r in regexes]


def _drop_entries(
    root: Any, drop: Sequence[str], path: Sequence[str]
) -> tuple[Any, tuple[str, ...], list[Any]]:
    """``root`` without the entries ``drop`` names, those names, and the keys they name (a
    key that is not a str is named by its text, where no str key has that name)."""
    # An entry named twice is left out once (and said once).
    names = list(dict.fromkeys(n for part in drop for n in part.split(",") if n))
    if not names:
        return root, (), []
    if not isinstance(root, Mapping):
        raise UsageError(
            "only a dict checkpoint has top-level entries to drop", argument="drop", flag="--drop"
        )
    by_text = {key_text(k): k for k in root if not isinstance(k, str)}
    keys = [n if n in root else by_text.get(n, n) for n in names]
    missing = [n for n, k in zip(names, keys, strict=True) if k not in root]
    kept = [key_text(k) for k in path[:1]]
    if missing or (kept and kept[0] in names):
        raise UsageError(
            f"cannot drop {', '.join(missing) or kept[0]}: the checkpoint's top-level entries "
            f"are {', '.join(repr(k) for k in root)}"
            + ("" if missing else " and the state dict to keep is under it"),
            argument="drop",
            value=repr(names),
            flag="--drop",
        )
    out = type(root)() if isinstance(root, dict) else {}
    for key, value in root.items():
        if key not in keys:
            out[key] = value
    return out, tuple(names), keys
