"""A rewrite of an opened checkpoint: plan the keys, check, write atomically, verify.

:mod:`ckpt_tools.ops.rewrite.rewriting` checks a rewrite's arguments and opens its input, then hands
it here. Apart so that the writers and the verification (half of a rewrite's modules) are
imported once the input is open: a user's command reaches its first read sooner (issue 13).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckpt_tools.descriptors import TensorRef
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.ops.preflight import check_key_types, check_rewritable
from ckpt_tools.ops.rewrite.plan import output_format_for, safetensors_plan, summary
from ckpt_tools.ops.rewrite.result import RewriteResult
from ckpt_tools.structure.keys import (
    KeyRule,
    WrapperMatch,
    apply_plan,
    plan_renames,
    strip_wrapper_rules,
)
from ckpt_tools.structure.selection import replace_at, select_state_dict

__all__ = ["apply_rewrite", "plan_strip"]


def apply_rewrite(
    ckpt: Checkpoint,
    src: str,
    dst: str,
    target: Path,
    rules: Sequence[KeyRule],
    *,
    select: str | Sequence[str] | None,
    output_format: str | None,
    device_map: Mapping[str, str] | None,
    verify: str,
    allow_globals: Sequence[str],
    drop_extras: bool,
    progress: Callable[[int, int], None] | None,
    dry_run: bool,
    durable: bool,
) -> RewriteResult:
    """Rewrite the opened ``ckpt`` into ``target``: the work of ``rewrite()``.

    ``rewrite`` checks its arguments and opens the input; everything after the input is open
    happens here, with the arguments it documents (``target`` is ``dst`` as
    :func:`~ckpt_tools.io.atomic.check_output_path` accepted it).

    Returns:
        The :class:`RewriteResult`.

    Raises:
        As :func:`~ckpt_tools.ops.rewrite.rewriting.rewrite`.
    """
    fmt = output_format_for(dst, output_format, ckpt.format)
    selection = select_state_dict(ckpt.root, select)
    check_rewritable(ckpt, allow_globals, selection.path, fmt)
    sd = selection.state_dict
    check_key_types(sd, rules, fmt, src)
    # Rules rename str keys only; other keys keep their type and value (checked above).
    plan = plan_renames([k for k in sd if isinstance(k, str)], rules)
    renamed_sd = apply_plan(sd, plan, rules)
    changed = [(old, new) for old, new in plan.items() if old != new]
    tensors = {k: v for k, v in renamed_sd.items() if isinstance(v, TensorRef)}
    # Torch outputs copy every storage the checkpoint keeps (optimizer state too).
    counted = tensors.values() if fmt == "safetensors" else ()
    total = sum(t.nbytes for t in counted) or sum(s.nbytes for s in ckpt.storages.values())
    check_output_size(list(counted), total, target)
    if fmt == "safetensors":
        for t in counted:
            ckpt.span(t.storage)  # a storage that cannot be copied is refused before writing
    # What the result states, written or planned (_result).
    stated = (src, dst, ckpt, fmt, selection.path, rules, len(changed), len(sd))
    if dry_run:  # what would be written, refusals included; nothing is
        dropped: tuple[str, ...] = ()
        if fmt == "safetensors":
            dropped = safetensors_plan(ckpt, selection.path, renamed_sd, drop_extras)[2]
        return _result(
            *stated,
            written=False,
            examples=tuple(changed),
            dropped=dropped,
            message=f"dry run: would write {dst} ({len(changed)} of {len(sd)} keys renamed, "
            f"{total} tensor bytes); nothing written",
        )
    done = [0]

    def on_bytes(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    dropped = ()
    with atomic_output(target, durable=durable) as out:
        # Each writer is imported for its own format: the other's modules are not needed.
        if fmt == "safetensors":
            from ckpt_tools.io.writers.safetensors import write_safetensors

            entries, metadata, dropped, expected = safetensors_plan(
                ckpt, selection.path, renamed_sd, drop_extras
            )
            write_safetensors(entries, ckpt, out.file, metadata, on_bytes, durable=out.durable)
            select_out: Sequence[str] = ()
        else:
            from ckpt_tools.io.writers.torchzip import picklable_tensors, write_torch_zip

            tree = replace_at(ckpt.root, selection.path, picklable_tensors(renamed_sd))
            write_torch_zip(tree, ckpt, out.file, device_map, on_bytes, durable=out.durable)
            expected, select_out = tensors, selection.path
        out.file.flush()
        verification = verify_output(str(out.path), Expected(expected, select_out, ckpt), verify)
    return _result(
        *stated,
        written=True,
        examples=tuple(changed[:3]),
        bytes_copied=done[0],
        verification=verification,
        dropped=dropped,
        device_map=dict(device_map or {}),
        message=summary(dst, ckpt.format, fmt, len(changed), len(sd), rules, device_map),
    )


def plan_strip(
    ckpt: Checkpoint, src: str, dst: str, options: Mapping[str, Any]
) -> tuple[tuple[KeyRule, ...], tuple[WrapperMatch, ...], RewriteResult | None]:
    """The wrapper rules ``strip-module`` applies to the opened ``ckpt``'s state dict.

    Args:
        ckpt: the opened input.
        src: its path, as the caller gave it.
        dst: the output path.
        options: :func:`~ckpt_tools.ops.rewrite.rewriting.rewrite`'s keyword arguments.

    Returns:
        ``(rules, matches, None)``; with nothing to strip, ``((), (), result)``: the result
        that says so, once the input has passed the refusals a rewrite of it would make (a
        file no rewrite may touch is never exit 0). The caller has checked ``dst``.
    """
    selection = select_state_dict(ckpt.root, options.get("select"))
    keys = [k for k in selection.state_dict if isinstance(k, str)]
    n_keys = len(selection.state_dict)
    rules, matches = strip_wrapper_rules(keys)
    if rules:
        return rules, matches, None
    fmt = output_format_for(dst, options.get("output_format"), ckpt.format)
    check_rewritable(ckpt, options.get("allow_globals", ()), selection.path, fmt)
    why = (
        f"nothing to strip: no wrapper prefix in the {n_keys} keys of {src}; {dst} was not written"
    )
    nothing = _result(
        src, None, ckpt, ckpt.format, selection.path, (), 0, n_keys, written=False, message=why
    )
    return (), (), nothing


def _result(
    src: str,
    dst: str | None,
    ckpt: Checkpoint,
    fmt: str,
    selected: tuple[str, ...],
    rules: Sequence[KeyRule],
    renamed: int,
    total_keys: int,
    **rest: Any,
) -> RewriteResult:
    """A rewrite's result: what every one states, then ``rest`` (written, planned, skipped)."""
    return RewriteResult(
        src=src,
        dst=dst,
        input_format=ckpt.format,
        output_format=fmt,
        selected=selected,
        rules=tuple(r.description for r in rules),
        renamed=renamed,
        total_keys=total_keys,
        **rest,
    )
