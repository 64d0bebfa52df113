"""``sanitize``: a checkpoint that plain ``torch.load(weights_only=True)`` loads.

The input is read by the restricted unpickler (nothing imported, nothing run), its object
tree made plain by :mod:`ckpt_tools.ops.sanitize.tree`, and written as every rewrite is:
tensor records copied from the input record by record, numpy arrays' bytes as new records,
a temp file, verification, rename. Torch is never imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckpt_tools._escape import shell_word
from ckpt_tools._types import Progress, Select, StrPath, VerifyLevel, checked_flags, checked_path
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import (
    Remedy,
    SelectError,
    UnsafeContentError,
    VerificationError,
    shown,
)
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.formats.pickle.limits import check_written_depth
from ckpt_tools.io.atomic import AtomicFile
from ckpt_tools.io.output_path import check_output_path
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.levels import NOT_VERIFIED, check_verify_level
from ckpt_tools.io.verify.outputs import Expected, tensor_digest, verify_output
from ckpt_tools.io.writers.output import write_file
from ckpt_tools.io.writers.progress import ByteCounter
from ckpt_tools.io.writers.torchzip import write_torch_zip
from ckpt_tools.ops.output_plan import PlannedFile, dry_run_fields
from ckpt_tools.ops.preflight import check_source
from ckpt_tools.ops.rewrite.plan import output_format_for
from ckpt_tools.ops.sanitize.records import torch_save_records
from ckpt_tools.ops.sanitize.result import Change, SanitizeResult
from ckpt_tools.ops.sanitize.tree import SanitizedTree, sanitize_tree
from ckpt_tools.structure.paths import parse_select
from ckpt_tools.structure.selection import select_state_dict
from ckpt_tools.structure.tensor_walk import (
    iter_listed_tensors,
    iter_stored_tensors,
    stored_views,
    tensors_by_place,
)

__all__ = ["SanitizeResult", "sanitize"]


@checked_flags
def sanitize(
    src: StrPath,
    dst: StrPath,
    *,
    refuse_unsafe: bool = False,
    select: Select = None,
    force: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> SanitizeResult:
    """Write ``src`` as a torch file that ``torch.load(weights_only=True)`` loads.

    Everything representable is kept, without importing or calling any class the file
    names: numpy arrays become tensors (bit-exact, from their pickled bytes), numpy scalars
    Python scalars, ``argparse.Namespace``, OmegaConf configs, ``defaultdict`` and dict
    subclasses holding items plain dicts and lists, paths strings, enums their values,
    pickled ``nn.Module`` s their state dict. Anything else is dropped and listed in the
    result (or, with ``refuse_unsafe``, refused).

    Args:
        src: the input checkpoint.
        dst: the output path (a torch zip file: not a ``.safetensors`` name).
        refuse_unsafe: refuse (exit 3) instead of dropping what cannot be kept
            (``ckpt sanitize --strict``).
        select: dotted path to the state dict whose tensors are verified; chosen
            automatically in the output when None. A root that is no mapping (a tensor, a list of
            them) has every tensor verified. It must name something the output keeps:
            one sanitize drops or converts away is refused before anything is written.
        force: replace an existing ``dst`` (never the input).
        verify: ``sizes`` (default: read the output back, keys, dtypes, shapes, sizes),
            ``full`` (also every byte of the state dict's tensors, compared with the input's) or
            ``none``.
        durable: fsync the output before naming it (default); False skips it, as ``cp``
            does (see :func:`~ckpt_tools.io.atomic.atomic_output`).
        dry_run: plan and check everything (``refuse_unsafe`` refusals included), write
            nothing: the result lists every conversion and drop, and ``planned`` the
            output's tensors.
        progress: called with ``(done_bytes, total_bytes)`` as tensor bytes are written
            (:data:`~ckpt_tools._types.Progress`).

    Returns:
        A :class:`SanitizeResult` listing every conversion and drop with its path.

    Raises:
        UnsafeContentError: ``refuse_unsafe`` and something would be dropped (exit 3).
        SelectError: ``select`` names an entry the input lacks, one that is no mapping, or
            one the output does not hold as the input does (dropped, or converted into
            something else): exit 2, nothing written.
        UsageError: a bad ``verify``, a ``.safetensors`` output name, or a DCP folder
            (consolidate it first; a Hugging Face folder is read as one checkpoint).
        ConversionError: a TorchScript archive (exit 7).
        SameFileError / OutputExistsError / OutputError: the output is refused or fails (exit 6).

    Example:
        >>> result = sanitize("model.pt", "plain.pt")  # already plain: copied as it is
        >>> result.tensors, result.converted, result.dropped
        (17, (), ())
        >>> result = sanitize("lightning.ckpt", "plain.pt")  # doctest: +SKIP
        >>> [str(c) for c in result.converted]  # doctest: +SKIP
        ['hyper_parameters.cfg: omegaconf.dictconfig.DictConfig -> dict']
    """
    check_verify_level(verify)
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    output_format_for(dst, "torch", "torch-zip", why="sanitize writes a torch file")
    target = check_output_path(dst, src, force=force, in_place=None)
    ckpt = open_checkpoint(src)
    # Refuses TorchScript and sharded folders; every global is allowed, since none is written.
    check_source(ckpt, ckpt.unsafe_globals)
    check_written_depth(ckpt.root)
    taken = set(ckpt.storages) | {name[5:] for name in ckpt.records if name.startswith("data/")}
    done = sanitize_tree(ckpt.root, taken)
    # A record torch.save never writes is left out and listed, as a value it cannot keep is:
    # the writer would copy it as it is, pickle payloads included.
    ckpt, records_dropped = torch_save_records(ckpt)
    done = replace(done, dropped=done.dropped + records_dropped)
    if refuse_unsafe and done.dropped:
        _refuse_drops(src, done)
    if select is not None:
        _check_selection(select, done)
    # Chosen in the output: a state dict in a dict subclass is found once it is a dict.
    selection = select_state_dict(done.root, select=select)
    planned = PlannedFile.of_tree(dst, done.root, attributes=True)
    check_output_size([], planned.nbytes, target)
    added = sum(len(b) for b in done.added.values())
    shared: dict[str, Any] = {
        "src": src,
        "dst": dst,
        "input_format": ckpt.format,
        "output_format": "torch-zip",
        "bytes_written": planned.nbytes,
        "bytes_copied": planned.nbytes - added,
        "dropped": tuple(c.path for c in done.dropped),
        "selected": selection.path,
        "tensors": len(_selected_tensors(done.root, selection.path)),
        "converted": done.converted,
        "dropped_values": done.dropped,
    }
    counts = f"{len(done.converted)} converted, {len(done.dropped)} dropped"
    if dry_run:
        message = (
            f"dry run: would sanitize {src} into {dst} ({counts}, {planned.nbytes} tensor bytes)"
        )
        return SanitizeResult(**shared, **dry_run_fields(dst, (planned,)), message=message)
    counter = ByteCounter(progress, planned.nbytes)

    def fill(out: AtomicFile) -> None:
        write_torch_zip(done.root, ckpt, out.file, None, counter, done.added, durable=out.durable)

    def check(path: str) -> str:
        return _verify(path, done, selection.path, ckpt, verify)

    return SanitizeResult(
        **shared,
        written=(dst,),
        verification=write_file(target, fill, check, replace=force, durable=durable),
        message=f"sanitized {src}: wrote {dst} ({counts}); "
        f"loads with torch.load(weights_only=True){_saved_on(done.root)}",
    )


_DROP_THEM = "to drop them and list them in the result"


def _refuse_drops(src: str, done: SanitizedTree) -> None:
    """``refuse_unsafe``: refuse (exit 3), naming what would be dropped."""
    shown = "; ".join(str(c) for c in done.dropped[:8])
    raise UnsafeContentError(
        f"{len(done.dropped)} value(s) of {src!r} cannot be made plain: {shown}",
        tuple(dict.fromkeys(c.was.partition(" ")[0] for c in done.dropped)),
        path=src,
        remedies=(
            # One fix, said to each audience in its own words.
            Remedy("refuse_unsafe", "False", text=_DROP_THEM),
            Remedy(flag="--strict", verb="leave out", text=_DROP_THEM),
        ),
    )


_LET_IT_CHOOSE = "to verify the state dict found in the output"


def _check_selection(select: Select, done: SanitizedTree) -> None:
    """Refuse, before anything is written, a ``select`` that the output does not hold.

    The selection names the state dict the written file is verified by, so one that
    sanitize drops (an object it cannot keep) or converts into something else (a pickled
    module's attributes) would only fail that verification after the work.

    Args:
        select: the selection the caller named, which the input holds.
        done: the sanitized tree the output is written from.

    Raises:
        SelectError: the output holds no state dict at ``select`` (exit 2), naming what
            sanitize does to it, and the selection that fixes it.
    """
    parts = parse_select(select) or ()
    try:
        select_state_dict(done.root, select=parts)
        return
    except SelectError as e:
        missing = e
    dotted = ".".join(parts)
    change = _change_above(dotted, done)
    remedies = [
        Remedy("select", "None", text=_LET_IT_CHOOSE),
        Remedy(flag="--select", verb="leave out", text=_LET_IT_CHOOSE),
    ]
    if change is None:
        why = f"the sanitized output does not hold it ({missing.message})"
    elif change.became == "dropped":
        where = shown(change.path or "the root")
        why = f"sanitize drops {where} ({shown(change.was)}), so the output holds nothing there"
    else:
        where, what = shown(change.path or "the root"), shown(f"{change.was} -> {change.became}")
        why = f"sanitize converts {where} ({what}), after which {missing.message}"
        if change.path and _holds_state_dict(done.root, change.path):
            what = f"to verify what {shown(change.path)} became"
            remedies.insert(0, Remedy("select", repr(change.path), text=what))
            remedies.insert(1, Remedy(flag=f"--select {shell_word(change.path)}", text=what))
    raise SelectError(
        why, argument="select", value=repr(dotted), flag="--select", remedies=remedies
    ) from missing


def _change_above(dotted: str, done: SanitizedTree) -> Change | None:
    """The drop or conversion at ``dotted`` or nearest above it: what became of it."""
    found = [
        c
        for c in (*done.dropped, *done.converted)
        if not c.path or dotted == c.path or dotted.startswith(c.path + ".")
    ]
    return max(found, key=lambda c: len(c.path), default=None)


def _holds_state_dict(root: Any, dotted: str) -> bool:
    try:
        select_state_dict(root, select=dotted)
    except SelectError:
        return False
    return True


def _saved_on(root: Any) -> str:
    """Where the written tensors are saved, when not on the CPU: torch.load puts them back
    there (the tensors of dropped objects are not written)."""
    found = iter_listed_tensors(root)
    devices = sorted({getattr(t, "storage", t).device for _, t in found} - {"cpu", "meta"})
    if not devices:
        return ""
    return f" (saved on {', '.join(devices)}: where that is missing, pass map_location='cpu')"


def _selected_tensors(root: Any, path: Sequence[str]) -> dict[Any, TensorRef | RebuiltTensor]:
    try:
        sd = select_state_dict(root, select=tuple(path)).state_dict
    except SelectError:  # the root holds no mapping, or was dropped (an auto selection)
        return {}
    return {k: v for k, v in sd.items() if isinstance(v, (TensorRef, RebuiltTensor))}


def _verify(
    tmp: str, done: SanitizedTree, path: Sequence[str], source: Checkpoint, level: str
) -> str:
    """The output's selected tensors as planned, and no global outside the allowlist.

    A root that is no mapping (a tensor, a list of them, None) has no state dict to select:
    the output's is chosen as the input's was (none), and every tensor of the tree is checked
    instead.
    """
    if level == "none":
        return NOT_VERIFIED
    whole_tree = not path and not isinstance(done.root, Mapping)
    expected = tensors_by_place(done.root) if whole_tree else _selected_tensors(done.root, path)
    parts = [p for t in expected.values() for p in stored_views(t)]
    new = [p for p in parts if p.storage.key in done.added]
    # A source that names no global: verify_output then refuses any the output names.
    # It compares copied tensors with the input; new records are compared here.
    none_allowed = replace(source, unsafe_globals=())
    select = None if whole_tree else path
    checked = Expected(expected, select, none_allowed, rebuilt=True)
    said = verify_output(tmp, checked, "sizes" if new else level)
    if not whole_tree and level != "full":
        return said
    out = open_checkpoint(tmp)
    count = _check_tree(out, done, source, level) if whole_tree else len(expected)
    if level == "full":
        _check_added(out, done)
        return f"verified: {count} tensors, keys, sizes and bytes"
    return f"verified: {count} tensors, sizes and sharing"


def _check_tree(out: Checkpoint, done: SanitizedTree, source: Checkpoint, level: str) -> int:
    """Every tensor of the tree, read back where it was written: dtype, shape, view and
    sharing (a sparse or nested tensor's parts each); at ``full`` the bytes of those copied
    from ``source``. Returns their count."""
    listed = iter_listed_tensors(out.root)
    planned = iter_listed_tensors(done.root)
    got, want = iter_stored_tensors(out.root), iter_stored_tensors(done.root)
    if [_geometry(p, t) for p, t in got] != [_geometry(p, t) for p, t in want] or [
        _kind(p, t) for p, t in listed
    ] != [_kind(p, t) for p, t in planned]:
        raise VerificationError("the written file's tensors differ from the planned ones")
    if _sharing(got) != _sharing(want):
        raise VerificationError("the written file's tensors share storages otherwise than planned")
    for (name, have), (_, was) in zip(got, want):
        copied = was.storage.key not in done.added
        if level == "full" and copied and tensor_digest(out, have) != tensor_digest(source, was):
            raise VerificationError(f"the bytes of {name!r} differ after writing")
    return len(listed)


def _geometry(path: str, t: TensorRef) -> tuple[Any, ...]:
    return (path, t.dtype, t.shape, t.stride, t.offset)


def _kind(path: str, t: TensorRef | RebuiltTensor) -> tuple[Any, ...]:
    layout = t.layout if isinstance(t, RebuiltTensor) else "strided"
    return (path, layout, t.dtype, t.shape)


def _sharing(found: Sequence[tuple[str, TensorRef]]) -> list[list[str]]:
    """The paths of the tensors, grouped by the storage they view."""
    groups: dict[int, list[str]] = {}
    for path, t in found:
        groups.setdefault(id(t.storage), []).append(path)
    return sorted(groups.values())


def _check_added(out: Checkpoint, done: SanitizedTree) -> None:
    """The new records' bytes (numpy arrays'), found through the tensors that view them: a
    source that is not a zip has its records numbered anew on the way out."""
    pairs = zip(
        iter_stored_tensors(out.root, attributes=True),
        iter_stored_tensors(done.root, attributes=True),
    )
    written = {w.storage.key: h.storage for (_, h), (_, w) in pairs if w.storage.key in done.added}
    for key, data in done.added.items():
        storage = written.get(key)
        if storage is None:
            raise VerificationError(f"the new record for storage {key!r} is not in the output")
        span = out.span(storage)
        with open(span.path, "rb") as f:
            f.seek(span.offset)
            if f.read(span.nbytes) != data:
                raise VerificationError(
                    f"the bytes of new record data/{storage.key} differ after writing"
                )
