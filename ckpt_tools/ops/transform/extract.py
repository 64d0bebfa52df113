"""``extract``: the tensors under one prefix, as a plain state dict (a backbone, an encoder)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ckpt_tools._types import OutputFormat, Progress, Select, StrPath, VerifyLevel, str_items
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.io.remote.checkpoint import opened
from ckpt_tools.ops.rewrite.plan import output_format_for
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.ops.transform.slim import select_weights
from ckpt_tools.ops.transform.state_dict_plan import finish, plan_state_dict_output

__all__ = ["extract"]


def extract(
    src: StrPath,
    dst: StrPath,
    *,
    prefix: str,
    strip_prefix: bool = False,
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
    """Write the selected state dict's entries under ``prefix`` as a plain state dict.

    Bytes are copied as they are (tied tensors stay tied, views stay views in torch outputs).

    Args:
        src: the input.
        dst: the output (``.pt`` or ``.safetensors``).
        prefix: keys starting with it are kept (``backbone.``).
        strip_prefix: remove ``prefix`` from the kept keys.
        ema: take the EMA copy, as ``slim(ema=True)`` does. A pickled ``nn.Module``
            selected (Ultralytics' ``model`` or ``ema``) gives up its recovered state dict.
        select, output_format, drop_extras, allow_globals, force, verify, durable, dry_run,
            progress: as for :func:`~ckpt_tools.ops.transform.slim.slim`.

    Returns:
        A :class:`TransformResult`.

    Raises:
        UsageError: ``prefix`` is empty (it would keep every key: that is
            ``slim(weights_only=True)``), or no key starts with it (the message lists the
            first segments).
        NonTensorEntriesError: a safetensors output, non-tensor entries under ``prefix`` and
            not ``drop_extras`` (exit 7).

    Example:
        >>> extract("model.pt", "layers.pt", prefix="layers.", strip_prefix=True).kept[:2]
        ('0.weight', '0.bias')
    """
    src, dst = os.fspath(src), os.fspath(dst)
    allow_globals = str_items(allow_globals, "allow_globals")
    target = check_output_path(dst, src, force=force, in_place=None)
    with opened(src) as ckpt:
        selection, notes = select_weights(ckpt, allow_globals, select, ema)
        keys = [str(k) for k in selection.state_dict]
        _check_prefix(prefix, keys)
        items = [
            (k, (k[len(prefix) :] if strip_prefix else k) if k.startswith(prefix) else None, v)
            for k, v in zip(keys, selection.state_dict.values())
        ]
        fmt = output_format_for(dst, output_format, ckpt.format)
        plan = plan_state_dict_output(
            ckpt,
            "extract",
            dst,
            fmt,
            selection,
            items,
            weights_only=True,
            drop_extras=drop_extras,
            notes=notes,
        )
        return finish(plan, target, ckpt, verify, dry_run, durable, progress, replace=force)


def _check_prefix(prefix: str, keys: Sequence[str]) -> None:
    """Refuse a prefix that keeps every key (the empty one) or none."""
    where = {"argument": "prefix", "value": repr(prefix), "flag": "--prefix"}
    if not prefix:
        # Every key starts with "": a part is what extract writes, and an empty prefix is
        # more often an unset variable than a wish for the whole state dict.
        raise UsageError(
            "an empty prefix would keep every key; extract writes the part under a prefix",
            **where,
            remedies=(
                Remedy(text="give the prefix of the part to keep (backbone.)"),
                Remedy(
                    "weights_only",
                    "True",
                    flag="--weights-only",
                    text="to slim, which writes the whole state dict",
                ),
            ),
        )
    if not any(k.startswith(prefix) for k in keys):
        heads = sorted({k.split(".")[0] + "." for k in keys})
        raise UsageError(
            f"no key starts with {prefix!r}; the keys start with {', '.join(heads[:10])}",
            **where,
        )
