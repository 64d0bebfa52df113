"""``sanitize``: a checkpoint that plain ``torch.load(weights_only=True)`` loads.

The input is read by the restricted unpickler (nothing imported, nothing run), its object
tree made plain by :mod:`ckpt_tools.ops.sanitize.tree`, and written as every rewrite is:
tensor records copied from the input record by record, numpy arrays' bytes as new records,
a temp file, verification, rename. Torch is never imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckpt_tools.descriptors import TensorRef, iter_tensors
from ckpt_tools.errors import (
    Remedy,
    SelectError,
    UnsafeContentError,
    VerificationError,
)
from ckpt_tools.formats import Checkpoint, open_checkpoint
from ckpt_tools.io.atomic import atomic_output, check_output_path
from ckpt_tools.io.space import check_output_size
from ckpt_tools.io.verify.levels import check_verify_level
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.io.writers.torchzip import write_torch_zip
from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor
from ckpt_tools.ops.preflight import check_source
from ckpt_tools.ops.sanitize.result import SanitizeReport
from ckpt_tools.ops.sanitize.tree import SanitizedTree, sanitize_tree
from ckpt_tools.structure.selection import select_state_dict

__all__ = ["SanitizeReport", "sanitize"]


def sanitize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    strict: bool = False,
    select: str | Sequence[str] | None = None,
    force: bool = False,
    verify: str = "sizes",
    dry_run: bool = False,
    durable: bool = True,
) -> SanitizeReport:
    """Write ``src`` as a torch file that ``torch.load(weights_only=True)`` loads.

    Everything representable is kept, without importing or calling any class the file
    names: numpy arrays become tensors (bit-exact, from their pickled bytes), numpy scalars
    Python scalars, ``argparse.Namespace``, OmegaConf configs and ``defaultdict`` plain dicts
    and lists, paths strings, enums their values, pickled ``nn.Module`` s their state dict.
    Anything else is dropped and listed in the report (or, with ``strict``, refused).

    Args:
        src: the input checkpoint.
        dst: the output path (a torch zip file).
        strict: refuse (exit 3) instead of dropping what cannot be kept.
        select: dotted path to the state dict whose tensors are verified; chosen
            automatically when None.
        force: replace an existing ``dst`` (never the input).
        verify: ``sizes`` (default), ``full`` (compare bytes) or ``none``.
        dry_run: plan and check everything (``strict`` refusals included), write nothing:
            the report lists every conversion and drop, and ``planned`` the output's tensors.
        durable: fsync the output before naming it (default); False skips it, as ``cp``
            does (see :func:`~ckpt_tools.io.atomic.atomic_output`).

    Returns:
        A :class:`SanitizeReport` listing every conversion and drop with its path.

    Raises:
        UnsafeContentError: ``strict`` and something would be dropped (exit 3).
        UsageError: a bad ``verify``, or a sharded folder or TorchScript archive (exit 2 / 7).
        SameFileError / OutputExistsError / OutputError: the output is refused or fails (exit 6).

    Example:
        >>> report = sanitize("model.pt", "plain.pt")  # already plain: copied as it is
        >>> report.tensors, report.converted, report.dropped
        (17, (), ())
        >>> report = sanitize("lightning.ckpt", "plain.pt")  # doctest: +SKIP
        >>> [str(c) for c in report.converted]  # doctest: +SKIP
        ['hyper_parameters.cfg: omegaconf.dictconfig.DictConfig -> dict']
    """
    check_verify_level(verify)
    src, dst = os.fspath(src), os.fspath(dst)
    target = check_output_path(dst, src, force=force)
    ckpt = open_checkpoint(src)
    # Refuses TorchScript and sharded folders; every global is allowed, since none is written.
    check_source(ckpt, ckpt.unsafe_globals)
    selection = select_state_dict(ckpt.root, select)
    taken = set(ckpt.storages) | {name[5:] for name in ckpt.records if name.startswith("data/")}
    done = sanitize_tree(ckpt.root, taken)
    if strict and done.dropped:
        shown = "; ".join(str(c) for c in done.dropped[:8])
        raise UnsafeContentError(
            f"{len(done.dropped)} value(s) of {src!r} cannot be made plain: {shown}",
            tuple(dict.fromkeys(c.was.partition(" ")[0] for c in done.dropped)),
            path=src,
            remedies=(
                Remedy(
                    "strict",
                    "False",
                    flag="--strict",
                    verb="leave out",
                    text="to drop them and list them in the report",
                ),
            ),
        )
    total = sum(s.nbytes for s in ckpt.storages.values()) + sum(map(len, done.added.values()))
    check_output_size([], total, target)
    if dry_run:
        return _planned(src, dst, ckpt.format, selection.path, done)
    copied = [0]

    def on_bytes(n: int) -> None:
        copied[0] += n

    with atomic_output(target, durable=durable) as out:
        write_torch_zip(
            done.root, ckpt, out.file, None, on_bytes, added=done.added, durable=out.durable
        )
        out.file.flush()
        verification = _verify(str(out.path), done, selection.path, ckpt, verify)
    tensors = _selected_tensors(done.root, selection.path)
    return SanitizeReport(
        src=src,
        dst=dst,
        input_format=ckpt.format,
        selected=selection.path,
        tensors=len(tensors),
        converted=done.converted,
        dropped=done.dropped,
        bytes_copied=copied[0],
        bytes_added=sum(len(b) for b in done.added.values()),
        verification=verification,
        message=(
            f"sanitized {src}: wrote {dst} ({len(done.converted)} converted, "
            f"{len(done.dropped)} dropped); loads with torch.load(weights_only=True)"
        ),
    )


def _planned(
    src: str, dst: str, input_format: str, path: tuple[str, ...], done: SanitizedTree
) -> SanitizeReport:
    """The report of a dry run: what would be converted, dropped and written; nothing is."""
    tensors = iter_tensors(done.root)
    storages = {id(t.storage): t.storage for _, t in tensors}
    added = sum(len(b) for b in done.added.values())
    written = sum(s.nbytes for s in storages.values())
    planned = PlannedFile(
        dst, tuple(PlannedTensor(k, t.dtype, t.shape, t.nbytes) for k, t in tensors), written
    )
    return SanitizeReport(
        src=src,
        dst=dst,
        input_format=input_format,
        selected=path,
        tensors=len(_selected_tensors(done.root, path)),
        converted=done.converted,
        dropped=done.dropped,
        bytes_copied=written - added,
        bytes_added=added,
        verification="",
        message=(
            f"dry run: would sanitize {src} into {dst} ({len(done.converted)} converted, "
            f"{len(done.dropped)} dropped, {written} tensor bytes); nothing written"
        ),
        written=False,
        planned=(planned,),
    )


def _selected_tensors(root: Any, path: Sequence[str]) -> dict[Any, TensorRef]:
    try:
        sd = select_state_dict(root, tuple(path)).state_dict
    except SelectError:  # the selection was dropped, or the root holds no mapping
        return {}
    return {k: v for k, v in sd.items() if isinstance(v, TensorRef)}


def _verify(
    tmp: str, done: SanitizedTree, path: Sequence[str], source: Checkpoint, level: str
) -> str:
    """The output's selected tensors as planned, and no global outside the allowlist."""
    if level == "none":
        return "not verified (--verify none)"
    expected = _selected_tensors(done.root, path)
    new = [t for t in expected.values() if t.storage.key in done.added]
    # A source that names no global: verify_output then refuses any the output names.
    # It compares copied tensors with the input; new records are compared here.
    none_allowed = replace(source, unsafe_globals=())
    said = verify_output(tmp, Expected(expected, path, none_allowed), "sizes" if new else level)
    if level == "full":
        _check_added(open_checkpoint(tmp), done.added)
        said = f"verified: {len(expected)} tensors, keys, sizes and bytes"
    return said


def _check_added(out: Checkpoint, added: Mapping[str, bytes]) -> None:
    for key, data in added.items():
        span = out.span(out.storages[key])
        with open(span.path, "rb") as f:
            f.seek(span.offset)
            if f.read(span.nbytes) != data:
                raise VerificationError(f"the bytes of new record data/{key} differ after writing")
