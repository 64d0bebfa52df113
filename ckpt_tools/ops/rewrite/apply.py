"""A rewrite of an opened checkpoint: plan the keys, check, write atomically, verify.

:mod:`ckpt_tools.ops.rewrite.rewriting` checks a rewrite's arguments and opens its input, then
hands it here. Apart so that the writers and the verification (half of a rewrite's modules) are
imported once the input is open: a user's command reaches its first read sooner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_tools._types import Select
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import ConversionError, Remedy, UsageError, shown
from ckpt_tools.formats import Checkpoint
from ckpt_tools.io.atomic import AtomicFile
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers.output import Check, Fill, write_file
from ckpt_tools.io.writers.progress import ByteCounter, Progress
from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor, dry_run_fields
from ckpt_tools.ops.preflight import check_key_types, check_rewritable
from ckpt_tools.ops.rewrite.plan import (
    format_family,
    matched_device_map,
    moved_devices,
    output_format_for,
    safetensors_plan,
    summary,
    torch_instead,
)
from ckpt_tools.ops.rewrite.result import RewriteResult
from ckpt_tools.structure.keys import (
    KeyRule,
    apply_plan,
    apply_rules,
    idle_rules,
    key_heads,
    plan_renames,
)
from ckpt_tools.structure.selection import (
    Selection,
    entries_beside,
    holds_no_state_dict,
    is_state_dict,
    replace_at,
    select_state_dict,
)
from ckpt_tools.structure.tensor_walk import tensors_by_place
from ckpt_tools.structure.wrappers import WrapperMatch, file_wrapper_rules, strip_wrapper_rules

if TYPE_CHECKING:
    from ckpt_tools.io.writers.safetensors import SafetensorsEntry

__all__ = ["apply_rewrite", "plan_strip"]


def apply_rewrite(
    ckpt: Checkpoint,
    src: str,
    dst: str,
    target: Path,
    rules: Sequence[KeyRule],
    *,
    select: Select,
    output_format: str | None,
    device_map: Mapping[str, str] | None,
    verify: str,
    allow_globals: Sequence[str],
    drop_extras: bool,
    progress: Progress | None,
    dry_run: bool,
    durable: bool,
    replace: bool,
) -> RewriteResult:
    """Rewrite the opened ``ckpt`` into ``target``: the work of ``rewrite()``.

    ``rewrite`` checks its arguments and opens the input; everything after the input is open
    happens here, with the arguments it documents (``target`` is ``dst`` as
    :func:`~ckpt_tools.io.output_path.check_output_path` accepted it; ``replace`` is ``force`` or
    ``in_place``: only then is a file at ``target`` replaced).

    Returns:
        The :class:`RewriteResult`.

    Raises:
        As :func:`~ckpt_tools.ops.rewrite.rewriting.rewrite`.
    """
    fmt = output_format_for(dst, output_format, format_family(ckpt))
    selection = select_state_dict(ckpt.root, select=select)
    check_rewritable(ckpt, allow_globals, selection.path, fmt)
    check_key_types(selection.state_dict, rules, fmt, src)
    plan = _plan(ckpt, selection, rules, fmt, drop_extras, target, torch_instead(dst))
    # A typo would write an unchanged copy; a root that is no mapping has no keys to match
    # and is written whole.
    if rules and not selection.stand_in:
        idle = rules if not plan.changed else idle_rules(list(selection.state_dict), rules)
        if idle:
            _refuse_unmatched(src, selection, idle, renamed=len(plan.changed))
    device_map = matched_device_map(ckpt, device_map) if device_map else None
    renamed, n_keys = len(plan.changed), len(selection.state_dict)
    stated = (src, dst, ckpt, fmt, selection.path, rules, renamed, n_keys)
    over = _not_renamed(ckpt, selection, rules)
    if dry_run:  # what would be written, refusals included; nothing is
        return _result(
            *stated,
            **dry_run_fields(dst, (plan.planned(dst),)),
            examples=tuple(plan.changed),
            dropped=plan.dropped,
            tensors=len(plan.expected),
            bytes_written=plan.total,
            bytes_copied=plan.copied,
            device_map=dict(device_map or {}),
            notes=over,
            message=f"dry run: would write {dst} ({_renamed(rules, renamed, n_keys)}"
            f"{plan.total} tensor bytes{_retagged(device_map)})",
        )
    counter = ByteCounter(progress, plan.total)
    fill, check = plan.fill(ckpt, device_map, counter), plan.check(ckpt, verify, device_map)
    verification = write_file(target, fill, check, replace=replace, durable=durable)
    return _result(
        *stated,
        written=(dst,),
        examples=tuple(plan.changed[:3]),
        bytes_written=plan.total,
        bytes_copied=plan.copied,
        verification=verification,
        dropped=plan.dropped,
        tensors=len(plan.expected),
        device_map=dict(device_map or {}),
        notes=over,
        message=summary(dst, ckpt.format, fmt, renamed, n_keys, rules, device_map),
    )


def _not_renamed(
    ckpt: Checkpoint, selection: Selection, rules: Sequence[KeyRule]
) -> tuple[str, ...]:
    """Notes naming each tensor dict beside the chosen one (an EMA's, a GAN's other half)
    whose keys the rules would rename: the rules rename the chosen state dict only."""
    if not rules or selection.stand_in:
        return ()
    found = []
    for name, value in entries_beside(ckpt.root, selection.path):
        keys = [k for k in value if isinstance(k, str)] if is_state_dict(value) else []
        if any(apply_rules(k, rules) != k for k in keys):
            found.append(
                f"not renamed: {name!r}, a tensor dict beside the chosen one, whose keys the "
                "rules would rename (select it to rename it)"
            )
    return tuple(found)


def _renamed(rules: Sequence[KeyRule], renamed: int, n_keys: int) -> str:
    """What a dry run says of the keys: nothing where no rule renames any (a retag)."""
    return f"{renamed} of {n_keys} keys renamed, " if rules else ""


def _retagged(device_map: Mapping[str, str] | None) -> str:
    """``device_map`` as a dry run's message says it: what the write would retag."""
    return f"; saved devices {moved_devices(device_map)}" if device_map else ""


def _refuse_unmatched(
    src: str, selection: Selection, rules: Sequence[KeyRule], renamed: int = 0
) -> None:
    """The refusal of ``rules`` that rename no key of the selected state dict (where the
    others rename ``renamed``, applied in order)."""
    described = ", ".join(r.description or r.pattern for r in rules)
    if not selection.state_dict:
        where = f"at {'.'.join(selection.path)!r}" if selection.path else "at the root"
        raise UsageError(
            f"the state dict of {src} ({where}) is empty: no key matches {described}; "
            "nothing would be renamed",
            argument="rules",
        )
    # Keys from the file, shown escaped: a line break in one cannot start a line of its own.
    heads = [shown(head) for head in key_heads(selection.state_dict)]
    outcome = (
        f"the other rules rename {renamed} of the keys (each rule applies to the keys the "
        "ones before it made); remove or fix it"
        if renamed
        else "nothing would be renamed"
    )
    raise UsageError(
        f"no key of {src} matches {described}; {outcome} (the keys start with "
        f"{', '.join(heads[:10])})",
        argument="rules",
    )


@dataclass(frozen=True)
class _RewritePlan:
    """A rewrite planned: what it writes, in the output's format, and what it leaves out.

    Attributes:
        changed: ``(old, new)`` of every key renamed.
        total: tensor bytes the output holds.
        copied: of those, the bytes copied as they lie in the input (views are gathered).
        dropped: names left out (tied tensors and non-tensor entries, for safetensors).
        tree: the torch output's object tree (None for safetensors).
        entries: the safetensors output's tensors.
        metadata: the safetensors header's ``__metadata__``.
        expected: the tensors the output's state dict must hold.
        select_out: where that state dict is in the output (None: chosen as for the input).
        safetensors: the output is a safetensors file (else a torch zip of ``tree``, which
            may be None: ``torch.save(None)``).
    """

    changed: list[tuple[str, str]]
    total: int
    copied: int
    dropped: tuple[str, ...]
    tree: Any
    entries: Sequence[SafetensorsEntry]
    metadata: Mapping[str, str]
    expected: Mapping[Any, TensorRef | RebuiltTensor]
    select_out: Sequence[str] | None
    safetensors: bool = False

    def planned(self, dst: str) -> PlannedFile:
        """The file a dry run shows."""
        if self.safetensors:
            return PlannedFile.of(dst, (PlannedTensor.of(e.name, e.tensor) for e in self.entries))
        return PlannedFile.of_tree(dst, self.tree)

    def fill(
        self, ckpt: Checkpoint, device_map: Mapping[str, str] | None, counter: ByteCounter
    ) -> Fill:
        """What writes the output: the format's writer, copying from ``ckpt``."""

        def fill(out: AtomicFile) -> None:
            # Each writer is imported for its own format: the other's modules are not needed.
            if self.safetensors:
                from ckpt_tools.io.writers.safetensors import source_records, write_safetensors

                records = source_records(self.entries, ckpt)
                write_safetensors(records, out.file, self.metadata, counter, durable=out.durable)
            else:
                from ckpt_tools.io.writers.torchzip import write_torch_zip

                write_torch_zip(self.tree, ckpt, out.file, device_map, counter, durable=out.durable)

        return fill

    def check(self, ckpt: Checkpoint, verify: str, device_map: Mapping[str, str] | None) -> Check:
        """The output read back against the planned tensors, at the level ``verify``; a torch
        output's device tags as ``device_map`` retags them (every other tag kept)."""
        devices = None if self.safetensors else dict(device_map or {})
        expected = Expected(self.expected, self.select_out, ckpt, rebuilt=True, devices=devices)
        return lambda path: verify_output(path, expected, verify)


def _plan(
    ckpt: Checkpoint,
    selection: Selection,
    rules: Sequence[KeyRule],
    fmt: str,
    drop_extras: bool,
    target: Path,
    to_torch: Remedy,
) -> _RewritePlan:
    """Rename the keys, then plan the output; every refusal happens here.

    ``to_torch``: the fix said for a dtype safetensors lacks (``dst`` names a format or not).
    """
    sd = selection.state_dict
    if selection.stand_in and fmt == "safetensors":
        raise ConversionError(
            f"{holds_no_state_dict(repr(ckpt.path), ckpt.root)}; a safetensors file holds "
            "named tensors",
            remedies=(to_torch,),
        )
    # Rules rename str keys only; other keys keep their type and value (checked above).
    renames = plan_renames([k for k in sd if isinstance(k, str)], rules)
    renamed_sd = apply_plan(sd, renames, rules)
    changed = [(old, new) for old, new in renames.items() if old != new]
    # Sparse, meta and nested tensors are copied too, and checked as tensors; a root that is
    # no mapping (a bare tensor, a list) by their places in it, as verification reads it back.
    tensors = (
        tensors_by_place(ckpt.root)
        if selection.stand_in
        else {k: v for k, v in renamed_sd.items() if isinstance(v, (TensorRef, RebuiltTensor))}
    )
    if fmt == "safetensors":
        entries, metadata, dropped, expected = safetensors_plan(
            ckpt, selection.path, renamed_sd, drop_extras, to_torch
        )
        total = sum(e.tensor.nbytes for e in entries)
        check_output_size([e.tensor for e in entries], total, target)
        for e in entries:
            ckpt.check_span(e.tensor.storage)  # a storage that cannot be copied is refused here
        from ckpt_tools.io.writers.safetensors import copied_bytes

        copied = copied_bytes(entries)
        plan = (changed, total, copied, dropped, None, entries, metadata, expected, ())
        return _RewritePlan(*plan, safetensors=True)
    from ckpt_tools.io.writers.torchzip import picklable_tensors

    # Torch outputs copy every storage the checkpoint keeps (optimizer state too).
    total = sum(s.nbytes for s in ckpt.storages.values())
    check_output_size([], total, target)
    # A root that is no mapping has no keys to rename: it is written as it is.
    tree = (
        ckpt.root
        if selection.stand_in
        else replace_at(ckpt.root, selection.path, picklable_tensors(renamed_sd))
    )
    select_out = None if selection.stand_in else selection.path  # None: read back as chosen
    return _RewritePlan(changed, total, total, (), tree, (), {}, tensors, select_out)


def plan_strip(
    ckpt: Checkpoint,
    src: str,
    dst: str,
    select: Select,
    output_format: str | None,
    allow_globals: Sequence[str],
    dry_run: bool = False,
) -> tuple[tuple[KeyRule, ...], tuple[WrapperMatch, ...], RewriteResult | None]:
    """The wrapper rules ``strip-module`` applies to the opened ``ckpt``'s state dict.

    Args:
        ckpt: the opened input.
        src: its path, as the caller gave it.
        dst: the output path.
        select, output_format, allow_globals, dry_run: the caller's, as
            :func:`~ckpt_tools.ops.rewrite.rewriting.strip_module` takes them.

    Returns:
        ``(rules, matches, None)``; with nothing to strip, ``((), (), result)``: the result
        that says so, once the input has passed the refusals a rewrite of it would make (a
        file no rewrite may touch is never exit 0). The caller has checked ``dst``.
    """
    selection = select_state_dict(ckpt.root, select=select)
    n_keys = len(selection.state_dict)
    # The wrappers inspect names for this file: none in an adapter's or a transformers file's.
    names = [k for k in selection.state_dict if isinstance(k, str)]
    wrappers = file_wrapper_rules(names, path=ckpt.path, fmt=ckpt.format, metadata=ckpt.metadata)
    rules, matches = strip_wrapper_rules(selection.state_dict, wrappers=wrappers)
    if rules:
        return rules, matches, None
    fmt = output_format_for(dst, output_format, format_family(ckpt))
    check_rewritable(ckpt, allow_globals, selection.path, fmt)
    # A dry run says it is one whatever it finds: it plans no file, and removes none.
    was = "would not be" if dry_run else "was not"
    why = f"nothing to strip: no wrapper prefix in the {n_keys} keys of {src}; {dst} {was} written"
    stated = (src, dst, ckpt, ckpt.format, selection.path, (), 0, n_keys)
    nothing = _result(*stated, dry_run=dry_run, message=why)
    return (), (), nothing


def _result(
    src: str,
    dst: str,
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
