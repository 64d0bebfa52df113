"""``extract``: the tensors under one prefix, as a plain state dict (a backbone, an encoder)."""

from __future__ import annotations

from collections.abc import Sequence

from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    str_items,
)
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.io.remote.checkpoint import opened
from ckpt_tools.ops.rewrite.plan import format_family, output_format_for
from ckpt_tools.ops.transform.plan import DROPPED
from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.ops.transform.slim import select_weights
from ckpt_tools.ops.transform.state_dict_plan import finish, plan_state_dict_output
from ckpt_tools.structure.keys import key_heads, strip_rule
from ckpt_tools.structure.paths import key_text

__all__ = ["extract"]


@checked_flags
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
        prefix: a module path: the keys equal to it or under it (starting with it and a
            dot) are kept, so ``layer1`` keeps ``layer1.weight`` but not ``layer10.weight``.
            Given with its trailing dot (``backbone.``), it keeps the keys starting with it.
        strip_prefix: remove ``prefix`` and its dot from the kept keys.
        ema: take the EMA copy, as ``slim(ema=True)`` does. A pickled ``nn.Module``
            selected (Ultralytics' ``model`` or ``ema``) gives up its recovered state dict.
        select, output_format, drop_extras, allow_globals, force, verify, durable, dry_run,
            progress: as for :func:`~ckpt_tools.ops.transform.slim.slim`.

    Returns:
        A :class:`TransformResult`.

    Raises:
        UsageError: ``prefix`` is empty (it would keep every key: that is
            ``slim(weights_only=True)``), no key lies under it (the message lists the first
            segments), or ``strip_prefix`` would leave a key empty (the message names each).
        NonTensorEntriesError: a safetensors output, non-tensor entries under ``prefix`` and
            not ``drop_extras`` (exit 7).

    Example:
        >>> extract("model.pt", "layers.pt", prefix="layers.", strip_prefix=True).kept[:2]
        ('0.weight', '0.bias')
        >>> extract("model.pt", "layer0.pt", prefix="layers.0", strip_prefix=True).kept
        ('weight', 'bias')
    """
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    allow_globals = str_items(allow_globals, "allow_globals")
    target = check_output_path(dst, src, force=force, in_place=None)
    with opened(src) as ckpt:
        selection, notes = select_weights(ckpt, allow_globals, select, ema)
        # A prefix is a module path: only str keys lie under one; others (0, (1, 2)) are
        # left out, never taken as strings (torch.load gives 1 and "1" as two keys), and
        # listed as left out by their text.
        keys = [k for k in selection.state_dict if isinstance(k, str)]
        _check_prefix(prefix, keys, strip_prefix, len(selection.state_dict) - len(keys))
        head = _head(prefix)
        items = [
            (k, (k[len(head) :] if strip_prefix else k) if _under(k, prefix) else DROPPED, v)
            if isinstance(k, str)
            else (key_text(k), DROPPED, v)
            for k, v in selection.state_dict.items()
        ]
        fmt = output_format_for(dst, output_format, format_family(ckpt))
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
            renames=[strip_rule(head)] if strip_prefix else (),
        )
        return finish(plan, target, ckpt, verify, dry_run, durable, progress, replace=force)


def _head(prefix: str) -> str:
    """What a key under the module ``prefix`` starts with: the prefix and its dot."""
    return prefix if prefix.endswith(".") else prefix + "."


def _under(key: str, prefix: str) -> bool:
    """Whether ``key`` is the module path ``prefix`` or lies under it.

    A bare ``startswith`` would take ``layer10.weight`` for ``layer1``, and stripping would
    turn it into ``0.weight``, a key of another module.
    """
    return key == prefix or key.startswith(_head(prefix))


def _check_prefix(prefix: str, keys: Sequence[str], strip: bool, others: int = 0) -> None:
    """Refuse a prefix that keeps every key (the empty one) or none, or a strip emptying keys."""
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
    if not any(_under(k, prefix) for k in keys):
        heads = key_heads(keys)
        found = (
            f"the keys start with {', '.join(heads[:10])}"
            if heads
            else "the state dict has no string keys"
        )
        if heads and others:
            found += f"; {others} keys are not strings (0, (1, 2)): they lie under no prefix"
        raise UsageError(f"no key lies under {prefix!r}; {found}", **where)
    # An empty name is no key of any module: load_state_dict could never place it.
    emptied = [
        repr(k) for k in keys if strip and _under(k, prefix) and k[len(_head(prefix)) :] == ""
    ]
    if emptied:
        raise UsageError(
            f"stripping {prefix!r} would leave an empty key for {', '.join(emptied)}; "
            "keep the prefix, or give the module under it",
            **where,
        )
