"""File-to-file rewrites: open, rename keys or retag devices, write atomically, verify.

Torch is never imported (except to make non-contiguous views contiguous for safetensors):
the object tree is read by the restricted unpickler, edited, and re-pickled, and tensor
bytes are copied record by record.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.io.atomic import check_output_path
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.io.writers.progress import Progress
from ckpt_tools.ops.rewrite.result import RewriteResult
from ckpt_tools.structure.keys import KeyRule, add_rule, regex_rule, strip_rule, sub_rule

if TYPE_CHECKING:
    from ckpt_tools.ops.transform.reshard import ShardsResult

__all__ = [
    "RewriteResult",
    "add_module_file",
    "convert",
    "rename_file",
    "retag",
    "rewrite",
    "strip_module_file",
]


def rewrite(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    rules: Sequence[KeyRule] = (),
    *,
    select: str | Sequence[str] | None = None,
    output_format: str | None = None,
    device_map: Mapping[str, str] | None = None,
    force: bool = False,
    in_place: bool = False,
    verify: str = "sizes",
    allow_globals: Sequence[str] = (),
    drop_extras: bool = False,
    progress: Progress | None = None,
    opened: Checkpoint | None = None,
    dry_run: bool = False,
    durable: bool = True,
) -> RewriteResult:
    """Rewrite a checkpoint file: rename its state dict's keys and/or retag devices.

    The rest of a nested checkpoint (epoch, optimizer state, hyper-parameters) is kept as it
    was. The output is written to a temp file beside ``dst``, verified, then renamed.

    Args:
        src: the input checkpoint.
        dst: the output path.
        rules: key rules applied to the selected state dict's keys (see
            ``ckpt_tools.structure.keys``).
        select: dotted path to the state dict; chosen automatically when None.
        output_format: ``torch`` or ``safetensors``; from ``dst``'s suffix when None.
        device_map: saved device tag -> new tag for every storage (torch outputs).
        force: replace an existing ``dst`` (never the input).
        in_place: allow ``dst`` to be ``src``.
        verify: ``sizes`` (default: read the output back, keys, dtypes, shapes, sizes),
            ``full`` (also every byte, compared with the input's) or ``none``.
        allow_globals: qualified names outside the allowlist to carry through unchanged.
        drop_extras: for safetensors outputs, drop non-tensor entries instead of refusing.
        progress: called with ``(done_bytes, total_bytes)`` as tensor bytes are written
            (:data:`~ckpt_tools.io.writers.progress.Progress`).
        opened: ``src`` already opened with ``open_checkpoint`` (saves reading it twice).
        dry_run: plan and check everything (refusals included), write nothing: the
            result's ``planned`` lists the file and its tensors, ``written`` is empty.
        durable: fsync the output before naming it (default); False skips it, as ``cp``
            does: faster where syncing is slow, but a power loss soon after may leave
            ``dst`` incomplete (see :func:`~ckpt_tools.io.atomic.atomic_output`).

    Returns:
        A :class:`RewriteResult`.

    Raises:
        UnsafeContentError: globals outside the allowlist and not in ``allow_globals`` (exit 3).
        KeyCollisionError: two keys would become one (exit 7).
        NonTensorEntriesError: safetensors output with non-tensor entries (exit 7).
        SameFileError / OutputExistsError / OutputError: the output is refused or fails (exit 6).

    Example:
        >>> result = rewrite("ddp.pt", "plain.pt", [strip_rule("module.")])
        >>> result.message, result.examples[0]
        ('wrote plain.pt (17 of 17 keys renamed)', ('module.conv.weight', 'conv.weight'))
    """
    check_verify_level(verify)
    src, dst = os.fspath(src), os.fspath(dst)
    target = check_output_path(dst, src, force=force, in_place=in_place)
    ckpt = opened if opened is not None and opened.path == src else open_checkpoint(src)
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
    )


def strip_module_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    prefix: str | None = None,
    **options: Any,
) -> RewriteResult:
    """Strip wrapper prefixes from a checkpoint file's state dict (``ckpt strip-module``).

    Args:
        src: the input.
        dst: the output.
        prefix: the prefix to strip; None strips every wrapper :func:`detect_wrappers` finds
            (``module.``, ``_orig_mod.``, FSDP and checkpoint-wrapper segments, ...).
        **options: passed to :func:`rewrite` (``select``, ``force``, ``verify`` ...).

    Returns:
        The :class:`RewriteResult`; when there is nothing to strip, nothing is written and
        ``written`` is empty.

    Example:
        >>> strip_module_file("ddp.pt", "plain.pt").wrappers[0].prefix
        'module.'
    """
    src = os.fspath(src)
    if prefix is not None:
        return rewrite(src, dst, [strip_rule(prefix)], **options)
    # The arguments and the output path first, then the input: rewrite()'s order, whether
    # or not there turns out to be something to strip.
    check_verify_level(options.get("verify", "sizes"))
    check_output_path(dst, src, options.get("force", False), options.get("in_place", False))
    ckpt = open_checkpoint(src)
    from ckpt_tools.ops.rewrite.apply import plan_strip  # (as in rewrite: after the read)

    rules, matches, nothing = plan_strip(ckpt, src, os.fspath(dst), options)
    if nothing is not None:
        return nothing
    result = rewrite(src, dst, rules, opened=ckpt, **options)
    names = ", ".join(repr(m.prefix) for m in matches)
    return _with(result, wrappers=matches, message=f"stripped {names}: {result.message}")


def _with(result: RewriteResult, **changes: Any) -> RewriteResult:
    from dataclasses import replace

    return replace(result, **changes)


def add_module_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    prefix: str = "module.",
    **options: Any,
) -> RewriteResult:
    """Add a wrapper prefix to every key (``ckpt add-module``), e.g. to load into DataParallel."""
    return rewrite(src, dst, [add_rule(prefix)], **options)


def rename_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    subs: Sequence[tuple[str, str]] = (),
    regexes: Sequence[tuple[str, str]] = (),
    **options: Any,
) -> RewriteResult:
    """Rename keys by prefix maps (``--sub OLD=NEW``) then regexes (``--regex PAT=REPL``).

    Raises:
        UsageError: no rule was given, or a regex does not compile.
    """
    rules = [sub_rule(old, new) for old, new in subs] + [regex_rule(p, r) for p, r in regexes]
    if not rules:
        raise UsageError(
            "give at least one rename rule",
            remedies=(
                Remedy("subs", "[('OLD', 'NEW')]", flag="--sub OLD=NEW"),
                Remedy(
                    "regexes", "[('PATTERN', 'REPLACEMENT')]", flag="--regex PATTERN=REPLACEMENT"
                ),
            ),
        )
    return rewrite(src, dst, rules, **options)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    format: str | None = None,
    *,
    max_shard_size: str | int | None = None,
    **options: Any,
) -> RewriteResult | ShardsResult:
    """Convert between torch and safetensors (format from ``dst``'s suffix unless given).

    To safetensors: tied tensors are stored once (dropped names recorded in the metadata),
    non-contiguous views are written contiguous, ``"format": "pt"`` metadata is added, and
    non-tensor entries are refused unless ``drop_extras=True``. From safetensors to torch:
    a plain state dict. ``src`` may be a Hugging Face sharded folder.

    To a Hugging Face sharded folder when ``dst`` is a folder (ends with ``/`` or exists)
    or ``max_shard_size`` is given: see :func:`ckpt_tools.ops.transform.reshard.convert_to_folder`,
    which returns a :class:`~ckpt_tools.ops.transform.reshard.ShardsResult`.

    Example:
        >>> result = convert("model.pt", "weights.safetensors")
        >>> result.output_format, result.written
        ('safetensors', ('weights.safetensors',))
    """
    if max_shard_size is not None or _names_folder(dst):
        from ckpt_tools.ops.transform.reshard import DEFAULT_MAX_SHARD_SIZE, convert_to_folder

        options.pop("in_place", None)  # a folder output never replaces its input
        size = DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
        return convert_to_folder(src, dst, size, **options)
    return rewrite(src, dst, (), output_format=format, **options)


def _names_folder(dst: str | os.PathLike[str]) -> bool:
    """``dst`` names a folder: it ends with a separator, or is an existing folder."""
    text = os.fspath(dst)
    return text.endswith(("/", os.sep)) or os.path.isdir(text)


def retag(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    mapping: Mapping[str, str],
    **options: Any,
) -> RewriteResult:
    """Rewrite the saved device tags of every storage (``{"cuda:1": "cpu"}``); bytes unchanged.

    Useful to make a GPU checkpoint load anywhere with plain ``torch.load``, or to make a
    CPU checkpoint look as if it was saved on a GPU (for tests).

    Raises:
        UsageError: a tag that is not ``cpu``, ``cuda``, ``cuda:N``, ``mps`` or ``meta``, or a
            ``.safetensors`` output (that format holds no device tags).
    """
    for tag in (*mapping.keys(), *mapping.values()):
        base, _, index = tag.partition(":")
        if base not in ("cpu", "cuda", "mps", "meta", "xpu", "hpu") or (
            index and not index.isdigit()
        ):
            raise UsageError(f"device tag {tag!r} is not like cpu, cuda or cuda:1")
    if os.fspath(dst).lower().endswith(".safetensors"):
        # Device tags live only in torch's format: writing one under this name would give a
        # file that safetensors cannot open and that its name misdescribes.
        pt = os.fspath(dst)[: -len(".safetensors")] + ".pt"
        raise UsageError(
            "retag writes saved device tags, which only torch files hold (a .safetensors file "
            "has none: the device is chosen when it is loaded)",
            argument="dst",
            value=repr(os.fspath(dst)),
            remedies=(Remedy(text=f"name a torch output instead, such as {pt!r}"),),
        )
    return rewrite(src, dst, (), output_format="torch", device_map=dict(mapping), **options)
