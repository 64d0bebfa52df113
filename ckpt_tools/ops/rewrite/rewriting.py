"""File-to-file rewrites: open, rename keys or retag devices, write atomically, verify.

Torch is never imported (except to make non-contiguous views contiguous for safetensors):
the object tree is read by the restricted unpickler, edited, and re-pickled, and tensor
bytes are copied record by record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    str_items,
    str_mapping,
)
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.ops.rewrite.result import RewriteResult
from ckpt_tools.structure.keys import KeyRule, add_rule, rule_items, strip_rule
from ckpt_tools.structure.wrappers import check_wrapper_prefix

__all__ = ["RewriteResult", "add_module", "rename", "rewrite", "strip_module"]


@checked_flags
def rewrite(
    src: StrPath,
    dst: StrPath,
    *,
    rules: Sequence[KeyRule] = (),
    device_map: Mapping[str, str] | None = None,
    select: Select = None,
    output_format: OutputFormat | None = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    in_place: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Rewrite a checkpoint file: rename its state dict's keys and/or retag devices.

    The rest of a nested checkpoint (epoch, optimizer state, hyper-parameters) is kept as it
    was. The output is written to a temp file beside ``dst``, verified, then renamed.

    Args:
        src: the input checkpoint.
        dst: the output path.
        rules: key rules applied to the selected state dict's keys (see
            ``ckpt_tools.structure.keys``).
        device_map: saved device tag -> new tag for every storage (torch outputs).
        select: dotted path to the state dict; chosen automatically when None.
        output_format: ``torch`` or ``safetensors``; from ``dst``'s suffix when None. A
            format the suffix contradicts (a torch file named ``.safetensors``) is refused.
        drop_extras: for safetensors outputs, drop non-tensor entries instead of refusing.
        allow_globals: qualified names outside the allowlist to carry through unchanged.
        force: replace an existing ``dst`` (never the input).
        in_place: allow ``dst`` to be ``src``.
        verify: ``sizes`` (default: read the output back, keys, dtypes, shapes, sizes),
            ``full`` (also every byte of the state dict's tensors, compared with the input's) or
            ``none``.
        durable: fsync the output before naming it (default); False skips it, as ``cp``
            does: faster where syncing is slow, but a power loss soon after may leave
            ``dst`` incomplete (see :func:`~ckpt_tools.io.atomic.atomic_output`).
        dry_run: plan and check everything (refusals included), write nothing: the
            result's ``planned`` lists the file and its tensors, ``written`` is empty.
        progress: called with ``(done_bytes, total_bytes)`` as tensor bytes are written
            (:data:`~ckpt_tools._types.Progress`).

    Returns:
        A :class:`RewriteResult`.

    Raises:
        UsageError: a bad ``verify`` or ``output_format``, or one ``dst``'s name contradicts;
            ``rules``, ``allow_globals`` or ``device_map`` of the wrong type; ``rules`` that
            rename no key (an empty state dict included), rather than an unchanged copy.
        UnsafeContentError: globals outside the allowlist and not in ``allow_globals`` (exit 3).
        KeyCollisionError: two keys would become one (exit 7).
        NonTensorEntriesError: safetensors output with non-tensor entries (exit 7).
        SameFileError / OutputExistsError / OutputError: the output is refused or fails (exit 6).

    Example:
        >>> result = rewrite("ddp.pt", "plain.pt", rules=[strip_rule("module.")])
        >>> result.message, result.examples[0]
        ('wrote plain.pt (17 of 17 keys renamed)', ('module.conv.weight', 'conv.weight'))
    """
    check_verify_level(verify)
    rules, allow_globals = rule_items(rules), str_items(allow_globals, "allow_globals")
    if device_map is not None:
        device_map = str_mapping(device_map, "device_map", "a dict of saved tag -> new tag")
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    target = check_output_path(dst, src, force=force, in_place=in_place)
    ckpt = open_checkpoint(src)
    # Imported once the input is open: the writers and the verification are half of a
    # rewrite's modules, and a user's command reaches its first read before loading them.
    from ckpt_tools.ops.rewrite.apply import apply_rewrite

    return apply_rewrite(
        ckpt,
        src,
        dst,
        target,
        rules,
        select=select,
        output_format=output_format,
        device_map=device_map,
        verify=verify,
        allow_globals=allow_globals,
        drop_extras=drop_extras,
        progress=progress,
        dry_run=dry_run,
        durable=durable,
        replace=force or bool(in_place),
    )


@checked_flags
def strip_module(
    src: StrPath,
    dst: StrPath,
    *,
    prefix: str | None = None,
    select: Select = None,
    output_format: OutputFormat | None = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    in_place: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Strip wrapper prefixes from a checkpoint file's state dict (``ckpt strip-module``).

    Args:
        src: the input.
        dst: the output.
        prefix: the prefix to strip, ending with ``.``; None strips every wrapper
            :func:`detect_wrappers` finds (``module.``, ``_orig_mod.``, FSDP and
            checkpoint-wrapper segments, ...).
        select, output_format, drop_extras, allow_globals, in_place: as for :func:`rewrite`.
        force, verify, durable, dry_run, progress: as for :func:`rewrite`.

    Returns:
        The :class:`RewriteResult`; when there is nothing to strip, nothing is written and
        ``written`` is empty.

    Raises:
        UsageError: ``prefix`` does not end with ``.``, or matches no key (an empty state dict
            included).
        As :func:`rewrite`.

    Example:
        >>> strip_module("ddp.pt", "plain.pt").wrappers[0].prefix
        'module.'
    """
    options: dict[str, Any] = {
        "select": select,
        "output_format": output_format,
        "drop_extras": drop_extras,
        "allow_globals": str_items(allow_globals, "allow_globals"),
        "verify": verify,
        "durable": durable,
        "dry_run": dry_run,
        "progress": progress,
    }
    if prefix is not None:
        rules = [strip_rule(check_wrapper_prefix(prefix))]
        return rewrite(src, dst, rules=rules, force=force, in_place=in_place, **options)
    # The arguments and the output path first, then the input: rewrite()'s order, whether
    # or not there turns out to be something to strip.
    check_verify_level(verify)
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    target = check_output_path(dst, src, force=force, in_place=in_place)
    ckpt = open_checkpoint(src)
    from ckpt_tools.ops.rewrite.apply import apply_rewrite, plan_strip  # (after the read)

    found, matches, nothing = plan_strip(
        ckpt, src, dst, select, output_format, allow_globals, dry_run
    )
    if nothing is not None:
        return nothing
    replace = force or bool(in_place)
    result = apply_rewrite(
        ckpt, src, dst, target, found, device_map=None, replace=replace, **options
    )
    names = ", ".join(repr(m.prefix) for m in matches)
    return _with(result, wrappers=matches, message=f"stripped {names}: {result.message}")


def _with(result: RewriteResult, **changes: Any) -> RewriteResult:
    from dataclasses import replace

    return replace(result, **changes)


@checked_flags
def add_module(
    src: StrPath,
    dst: StrPath,
    *,
    prefix: str = "module.",
    select: Select = None,
    output_format: OutputFormat | None = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    in_place: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Add a wrapper prefix to every key (``ckpt add-module``), e.g. to load into DataParallel.

    Args:
        src: the input.
        dst: the output.
        prefix: the prefix to add, ending with ``.``.
        select, output_format, drop_extras, allow_globals, in_place: as for :func:`rewrite`.
        force, verify, durable, dry_run, progress: as for :func:`rewrite`.

    Returns:
        The :class:`RewriteResult`.

    Raises:
        UsageError: ``prefix`` does not end with ``.``, or the state dict is empty.
        As :func:`rewrite`.

    Example:
        >>> add_module("model.pt", "wrapped.pt").examples[0]
        ('conv.weight', 'module.conv.weight')
    """
    return rewrite(
        src,
        dst,
        rules=[add_rule(check_wrapper_prefix(prefix))],
        select=select,
        output_format=output_format,
        drop_extras=drop_extras,
        allow_globals=allow_globals,
        force=force,
        in_place=in_place,
        verify=verify,
        durable=durable,
        dry_run=dry_run,
        progress=progress,
    )


@checked_flags
def rename(
    src: StrPath,
    dst: StrPath,
    *,
    rules: Sequence[KeyRule],
    select: Select = None,
    output_format: OutputFormat | None = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    in_place: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Rename keys by rules, in order (``ckpt rename --sub OLD=NEW --regex PAT=REPL``).

    Args:
        src: the input.
        dst: the output.
        rules: :class:`~ckpt_tools.structure.keys.KeyRule` s, applied in order:
            ``sub_rule("backbone.", "encoder.")``, ``regex_rule(r"^blocks\\.", "layers.")``.
        select, output_format, drop_extras, allow_globals, in_place: as for :func:`rewrite`.
        force, verify, durable, dry_run, progress: as for :func:`rewrite`.

    Returns:
        The :class:`RewriteResult`.

    Raises:
        UsageError: no rule was given, or ``rules`` is not :class:`KeyRule` s (a
            ``"OLD=NEW"`` string, ``("OLD", "NEW")`` pairs).
        KeyCollisionError, and as :func:`rewrite`.

    Example:
        >>> from ckpt_tools import sub_rule
        >>> rename("model.pt", "renamed.pt", rules=[sub_rule("conv.", "stem.")]).examples[0]
        ('conv.weight', 'stem.weight')
    """
    rules = rule_items(rules)
    if not rules:
        raise UsageError(
            "give at least one rename rule",
            remedies=(
                Remedy("rules", "[sub_rule('OLD', 'NEW')]", flag="--sub OLD=NEW"),
                Remedy(flag="--regex PATTERN=REPLACEMENT"),
            ),
        )
    return rewrite(
        src,
        dst,
        rules=rules,
        select=select,
        output_format=output_format,
        drop_extras=drop_extras,
        allow_globals=allow_globals,
        force=force,
        in_place=in_place,
        verify=verify,
        durable=durable,
        dry_run=dry_run,
        progress=progress,
    )
