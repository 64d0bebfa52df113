"""Planning a rewrite: is the source rewritable, which output format, what goes in it.

Kept apart from :mod:`~.rewriting` (which opens, writes and verifies) so each module has one job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ckpt_tools._escape import shell_word
from ckpt_tools._types import one_of
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import (
    ConversionError,
    Remedy,
    UnsafeContentError,
    UnsupportedFormatError,
    UsageError,
    shown,
)
from ckpt_tools.formats import Checkpoint
from ckpt_tools.structure.keys import KeyRule
from ckpt_tools.structure.selection import entries_beside, is_state_dict

if TYPE_CHECKING:
    from ckpt_tools.io.writers.safetensors import SafetensorsEntry

__all__ = [
    "check_source",
    "format_named_by",
    "free_name",
    "matched_device_map",
    "output_format_for",
    "safetensors_plan",
    "summary",
    "torch_instead",
]


#: Suffixes that name a torch file; ``.safetensors`` names a safetensors file.
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl")
_FORMATS = {"torch": "torch-zip", "safetensors": "safetensors"}
_SUFFIX = {"torch-zip": ".pt", "safetensors": ".safetensors"}


def format_named_by(dst: str | os.PathLike[str]) -> str | None:
    """The format ``dst``'s suffix names: ``safetensors``, ``torch-zip``, or None for another.

    The one place a file name decides a format (every rewrite, transform and consolidate).

    Example:
        >>> format_named_by("w.safetensors"), format_named_by("w.PT"), format_named_by("out/")
        ('safetensors', 'torch-zip', None)
    """
    suffix = os.path.splitext(os.fspath(dst))[1].lower()
    if suffix == ".safetensors":
        return "safetensors"
    return "torch-zip" if suffix in _TORCH_SUFFIXES else None


def format_family(ckpt: Checkpoint) -> str:
    """The input's format as :func:`output_format_for` takes it: a sharded folder whose
    shards are all safetensors is ``safetensors``, as one safetensors file is.

    Example:
        >>> format_family(Checkpoint("a.pt", "torch-zip", {}, {}))
        'torch-zip'
    """
    shards = ckpt.shards.values()
    if ckpt.format == "hf-sharded" and shards and all(s.format == "safetensors" for s in shards):
        return "safetensors"
    return ckpt.format


def output_format_for(
    dst: str | os.PathLike[str],
    output_format: str | None,
    input_format: str,
    *,
    why: str = "",
) -> str:
    """The output format: ``output_format``, else ``dst``'s suffix, else the input's family.

    Args:
        dst: the output path.
        output_format: the caller's ``output_format`` (``torch``, ``safetensors`` or None).
        input_format: the input's format (a safetensors input stays safetensors), as
            :func:`format_family` gives it.
        why: what asks for ``output_format`` when the caller did not (``retag`` writes
            torch): said instead of naming the argument when the name contradicts it.

    Returns:
        ``torch-zip`` or ``safetensors``.

    Raises:
        UsageError: an unknown format, or one ``dst``'s suffix contradicts (a torch file
            under a ``.safetensors`` name, or the reverse): the remedy names the file that
            fits. Nothing has been written.

    Example:
        >>> try:
        ...     output_format_for("x.safetensors", "torch", "torch-zip")
        ... except UsageError as e:
        ...     print(e)
        output_format='torch': 'x.safetensors' is named as a safetensors file, and a torch
        file would be written under it; name it 'x.pt'
    """
    named = format_named_by(dst)
    if output_format is None:
        return named or ("safetensors" if input_format == "safetensors" else "torch-zip")
    fmt = _FORMATS[one_of(output_format, tuple(_FORMATS), "output_format", flag="--format")]
    if named is not None and named != fmt:
        name = os.fspath(dst)
        fits = free_name(name, _SUFFIX[fmt])
        noun = {"torch-zip": "a torch file", "safetensors": "a safetensors file"}
        message = f"{name!r} is named as {noun[named]}, and {noun[fmt]} would be written under it"
        raise UsageError(
            f"{why}: {message}" if why else message,
            argument=None if why else "output_format",
            value=None if why else repr(output_format),
            flag=None if why else "--format",
            path=name,
            remedies=(Remedy(text=f"name it {fits!r}"),),
        )
    return fmt


def free_name(dst: str | os.PathLike[str], suffix: str) -> str:
    """A name for ``dst`` with ``suffix`` instead of its own, naming no file that exists.

    A remedy that names the file that fits must name one the command would write: with the
    suffix swapped, ``mk.safetensors`` becomes ``mk.pt``, which is often the input itself
    (``convert mk.pt mk.safetensors``) or another file an output may not replace. Then
    ``mk.converted.pt``, then ``mk.converted-2.pt`` and on, until one is free.

    Args:
        dst: the output name the caller gave.
        suffix: the suffix the name must end with (``.pt``).

    Returns:
        The first of those names that no file (not even a dangling link) has.

    Example:
        >>> free_name("no-such-folder/w.safetensors", ".pt")
        'no-such-folder/w.pt'
    """
    stem = os.path.splitext(os.fspath(dst))[0]
    candidate, n = stem + suffix, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{stem}.converted{suffix}" if n == 2 else f"{stem}.converted-{n - 1}{suffix}"
    return candidate


def torch_instead(dst: str | os.PathLike[str], *, folder: bool = False) -> Remedy:
    """The fix for a safetensors output that cannot hold a tensor: a torch output instead.

    ``output_format='torch'`` (``--format torch``) is said only where it is enough: a
    ``.safetensors`` name refuses a torch format (:func:`output_format_for`), so there the
    file that fits is named (never one that exists, such as the input: :func:`free_name`),
    and a folder output holds safetensors shards only.

    Example:
        >>> torch_instead("w.safetensors").render(for_cli=True)
        "keep the torch format: name the output 'w.pt'"
        >>> torch_instead("w").render(for_cli=True)
        'pass --format torch to keep it in torch format'
        >>> torch_instead("shards/", folder=True).render()
        'keep the torch format: write a .pt file, not a folder'
    """
    if folder:  # a folder holds safetensors shards: the torch format is one file
        return Remedy(text="keep the torch format: write a .pt file, not a folder")
    if format_named_by(dst) == "safetensors":
        fits = free_name(dst, _SUFFIX["torch-zip"])
        return Remedy(text=f"keep the torch format: name the output {fits!r}")
    return Remedy(
        "output_format", "'torch'", flag="--format torch", text="to keep it in torch format"
    )


def check_source(ckpt: Checkpoint, allow_globals: Sequence[str]) -> None:
    """Refuse an input no rewrite may write from, before anything is planned.

    Args:
        ckpt: the opened input.
        allow_globals: globals outside the allowlist the caller allows through.

    Raises:
        ConversionError: a TorchScript archive, or a DCP folder (consolidate it first).
        UnsafeContentError: globals outside the allowlist, not allowed.
        UnsupportedFormatError: big-endian storages, which outputs cannot hold.
        CorruptCheckpointError: a zip record's bytes do not match its CRC-32.
    """
    if ckpt.format == "torchscript":
        raise ConversionError(
            f"{ckpt.path!r} is a TorchScript archive: its code refers to the attribute names, so "
            "rewriting the file would break it; load it with torch.jit.load and save the "
            "state_dict()"
        )
    if ckpt.format == "dcp":
        from ckpt_tools.formats.dcp.reader import needs_consolidating

        raise needs_consolidating(ckpt.path)
    refused = tuple(g for g in ckpt.unsafe_globals if g not in set(allow_globals))
    if refused:
        raise UnsafeContentError(
            f"{ckpt.path!r} refers to Python globals outside the allowlist: {', '.join(refused)} "
            "(they are never imported)",
            refused,
            path=ckpt.path,
            remedies=(
                Remedy(
                    "allow_globals",
                    repr(list(refused)),
                    flag=" ".join(f"--allow-global {shell_word(g)}" for g in refused),
                    text="to carry them through unchanged",
                ),
            ),
        )
    _refuse_big_endian(ckpt)
    # A zip's records are copied as they are, CRC-32 included. A remote zip's records are
    # fetched and written anew (the writer computes each CRC), so its input is not re-read.
    if ckpt.records and not ckpt.remote:
        # Imported for zips only, as each writer is: a rewrite reaches its first read sooner.
        from ckpt_tools.io.verify.zipcheck import check_source_crcs

        check_source_crcs(ckpt)  # after the safety refusals: they say more about such a file


def _refuse_big_endian(ckpt: Checkpoint) -> None:
    """Refuse big-endian storages: every output copies or reads storage bytes as
    little-endian (its byteorder record says so), which would change their values. Storages
    of one-byte elements read alike in either order, and pass."""
    big = [
        c.path
        for c in (ckpt, *ckpt.shards.values())
        if c.byteorder == "big" and any(itemsize(s.dtype) > 1 for s in c.storages.values())
    ]
    if big:
        # The loaders read local files only: a URL's file is downloaded first.
        first = "download it first; then " if ckpt.remote else ""
        raise UnsupportedFormatError(
            f"{big[0]!r} was saved big-endian (its byteorder record says big): a rewrite "
            "copies storage bytes into a little-endian output, which would change every value "
            f"wider than a byte, so it is refused; {first}load_state_dict reads it "
            "(byte-swapped, as torch.load does), and torch.save writes it again little-endian",
            path=big[0],
        )


def matched_device_map(ckpt: Checkpoint, device_map: Mapping[str, str]) -> dict[str, str]:
    """The entries of ``device_map`` whose saved tag some storage of ``ckpt`` has.

    A retag that matches nothing would write a copy and call it retagged: it is refused,
    with the tags the file does have and the mapping that would move them. So is an entry
    that matches nothing while a saved tag stays unmapped (a typo, ``cuda:2`` for
    ``cuda:1``, would leave those storages where plain ``torch.load`` fails); entries for
    tags the file lacks beside a mapping that covers every tag it has are passed over.

    Raises:
        UsageError: no storage is saved on a tag ``device_map`` names, and a saved tag is
            left unmapped.
    """
    saved: dict[str, int] = {}
    for storage in ckpt.storages.values():
        saved[storage.device] = saved.get(storage.device, 0) + 1
    matched = {a: b for a, b in device_map.items() if a in saved}
    idle = [a for a in device_map if a not in saved]
    # Saved tags left where they are, but the CPU (which plain torch.load reads anywhere:
    # a GPU run's rng_state stays there) and those the mapping also targets (merged into:
    # a chain, cuda:1=cuda:0 cuda:2=cuda:1, is torch's too, and looks as a mistyped swap).
    left = [t for t in saved if t not in matched and t not in device_map.values() and t != "cpu"]
    if not device_map or (matched and (not idle or not left)):
        return matched
    if matched:
        has = ", ".join(f"{shown(tag)} ×{n}" for tag, n in saved.items())
        fixes = [
            Remedy(
                "mapping",
                repr({**matched, tag: device_map[idle[0]]}),
                flag=f"--map {shell_word(f'{tag}={device_map[idle[0]]}')}",
                text=f"in place of {idle[0]}",
            )
            for tag in left
            if tag != device_map[idle[0]]
        ]
        raise UsageError(
            f"no storage is saved on {' or '.join(idle)}, and {' and '.join(left)} would "
            f"stay unmapped (saved: {has})",
            path=ckpt.path,
            remedies=fixes or (Remedy(text=f"leave out {' and '.join(idle)}"),),
        )
    target = next(iter(device_map.values()))
    has = ", ".join(f"{shown(tag)} ×{n}" for tag, n in saved.items()) or "no storages"
    fixes = [
        Remedy("mapping", repr({tag: target}), flag=f"--map {shell_word(f'{tag}={target}')}")
        for tag in saved
        if tag != target
    ]
    raise UsageError(
        f"no storage is saved on {' or '.join(device_map)} (saved: {has})",
        path=ckpt.path,
        remedies=fixes or (Remedy(text=f"nothing to retag: every storage is on {target}"),),
    )


def moved_devices(device_map: Mapping[str, str]) -> str:
    """A device map as results say it: ``cuda:1 -> cpu, cuda:0 -> cpu``."""
    return ", ".join(f"{a} -> {b}" for a, b in device_map.items())


def summary(
    dst: str,
    input_format: str,
    output_format: str,
    renamed: int,
    total: int,
    rules: Sequence[KeyRule],
    device_map: Mapping[str, str] | None,
) -> str:
    if rules:
        return f"wrote {dst} ({renamed} of {total} keys renamed)"
    if device_map:
        return f"retagged saved devices ({moved_devices(device_map)}): wrote {dst}"
    return f"converted {input_format} to {output_format}: wrote {dst} ({total} entries)"


def safetensors_plan(
    ckpt: Checkpoint,
    path: Sequence[str],
    sd: Mapping[str, Any],
    drop_extras: bool,
    to_torch: Remedy | None = None,
) -> tuple[list[SafetensorsEntry], dict[str, str], tuple[str, ...], dict[str, TensorRef]]:
    """The safetensors output of ``sd``; ``to_torch`` is the fix said for a dtype it lacks
    (:func:`torch_instead`; "keep the torch format" when None)."""
    from ckpt_tools.io.writers.safetensors import (
        SafetensorsEntry,
        check_holdable,
        leave_out_extras,
        tensor_attributes,
        tied_names,
        unholdable_kind,
    )

    extras = [str(k) for k, v in sd.items() if not isinstance(v, TensorRef)]
    beside = entries_beside(ckpt.root, path)
    extras += [name for name, _ in beside]
    # A tensor's Python attributes cannot go in either: left out and listed, not refused.
    attributes = tensor_attributes((str(k), v) for k, v in sd.items())
    # Sparse, nested and meta tensors are named as tensors safetensors cannot hold; a tensor
    # beside the state dict (a best accuracy) as one outside it, not as a non-tensor entry.
    kinds = {str(k): kind for k, v in sd.items() if (kind := unholdable_kind(v)) is not None}
    outside = {name for name, v in beside if isinstance(v, (TensorRef, RebuiltTensor))}
    # Another state dict beside the chosen one (a GAN's): named as one, not as an entry.
    dicts = [name for name, v in beside if is_state_dict(v)]
    left_out = leave_out_extras(
        extras, ckpt.path, drop_extras=drop_extras, kinds=kinds, outside=outside, dicts=dicts
    ) + tuple(attributes)
    # String values only: an HF index's metadata also holds its int total_size.
    metadata = {k: v for k, v in (ckpt.metadata or {}).items() if isinstance(v, str)}
    metadata.setdefault("format", "pt")

    entries: list[SafetensorsEntry] = []
    expected: dict[str, TensorRef] = {}
    dropped: list[str] = []
    tied: dict[str, TensorRef] = {}
    # Tied tensors are stored once; the dropped name maps to the kept one in the metadata.
    ties = tied_names((str(k), v) for k, v in sd.items() if isinstance(v, TensorRef))
    for name, t in sd.items():
        if not isinstance(t, TensorRef):
            continue
        if str(name) in ties:
            dropped.append(str(name))
            tied[str(name)] = t
            continue
        entries.append(SafetensorsEntry(str(name), t))
        expected[str(name)] = t
    from ckpt_tools.formats.safetensors import tie_metadata  # (safetensors outputs only)

    metadata.update(tie_metadata(ties, beside=metadata))
    expected.update(tied)  # reading the output gives them back, after the stored names
    fixes = () if to_torch is None else (to_torch,)
    check_holdable([(e.name, e.tensor) for e in entries], ckpt.path, fixes)
    return entries, metadata, left_out + tuple(dropped), expected
