"""``convert`` and ``retag``: rewrites that change what the output is (its format, its shards,
its saved device tags) rather than its keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    count_of,
    str_mapping,
)
from ckpt_tools.errors import UsageError
from ckpt_tools.ops.rewrite.plan import output_format_for
from ckpt_tools.ops.rewrite.result import RewriteResult
from ckpt_tools.ops.rewrite.rewriting import rewrite

__all__ = ["convert", "retag"]


@checked_flags
def convert(
    src: StrPath,
    dst: StrPath,
    *,
    output_format: OutputFormat | None = None,
    max_shard_size: str | int | None = None,
    select: Select = None,
    drop_extras: bool = False,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    in_place: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
    jobs: int = 1,
) -> RewriteResult:
    """Convert between torch, safetensors and Hugging Face sharded folders (``ckpt convert``).

    To safetensors: tied tensors are stored once (dropped names recorded in the metadata),
    non-contiguous views are written contiguous, ``"format": "pt"`` metadata is added,
    tensors' Python attributes are left out (listed in ``dropped``), and non-tensor entries
    are refused unless ``drop_extras=True``. From safetensors to torch: a plain state dict.
    ``src`` may be a Hugging Face sharded folder.

    Args:
        src: a ``.pt``, ``.safetensors`` or sharded folder (any format
            :func:`~ckpt_tools.formats.open_checkpoint` reads).
        dst: the output file, or a folder for Hugging Face shards (it ends with ``/`` or is
            an existing folder; it must be empty unless ``force``, which replaces its weight
            files and keeps the rest, as ``reshard`` does). A sharded output named like
            a file (``out.pt``) is refused.
        output_format: ``torch`` or ``safetensors``; from ``dst``'s suffix when None, and
            refused where the suffix says otherwise. A folder output is safetensors.
        max_shard_size: write a sharded folder with shards up to this size (``"5GB"`` =
            5*10**9, ``"2GiB"``, or bytes); ``"5GB"`` when ``dst`` names a folder.
        select, drop_extras, allow_globals, force, verify, durable, dry_run, progress: as for
            :func:`rewrite`.
        in_place: allow ``dst`` to be ``src`` (a file output; a folder never replaces its
            input).
        jobs: shards written at once, by threads (folder outputs).

    Returns:
        A :class:`RewriteResult` (for a folder, ``written`` is the shards then the index,
        and ``max_shard_size`` the limit in bytes).

    Raises:
        UsageError: a format the name contradicts, a bad ``max_shard_size`` or ``jobs``.
        NonTensorEntriesError: safetensors output with non-tensor entries (exit 7).
        And as :func:`rewrite`.

    Example:
        >>> result = convert("model.pt", "weights.safetensors")
        >>> result.output_format, result.written
        ('safetensors', ('weights.safetensors',))
        >>> convert("model.pt", "model-hf/").written
        ('model-hf/model.safetensors',)
    """
    from ckpt_tools.io.output_path import wants_folder

    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    count_of(jobs, "jobs", flag="--jobs")  # (a file output writes with one thread)
    if not wants_folder(dst, max_shard_size):
        return rewrite(
            src,
            dst,
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
    from ckpt_tools.ops.transform.reshard import convert_to_folder

    return convert_to_folder(
        src,
        dst,
        max_shard_size=max_shard_size,
        output_format=output_format,
        select=select,
        drop_extras=drop_extras,
        allow_globals=allow_globals,
        force=force,
        verify=verify,
        durable=durable,
        dry_run=dry_run,
        progress=progress,
        jobs=jobs,
    )


# The tags torch's default_restore_location reads back: the CPU and meta bare, the
# accelerators with an optional index in plain digits (torch.device refuses "cuda:01") that
# fits torch's 8-bit device index (cuda:128 reads back as cuda:-128).
_DEVICE_TAG = re.compile(
    r"(cpu|meta)|(cuda|mps|xpu|hpu)(:([0-9]|[1-9][0-9]|1[01][0-9]|12[0-7]))?", re.ASCII
)

_DEVICE_TAGS_WHY = (
    "retag writes saved device tags, which only torch files hold (a .safetensors file has "
    "none: the device is chosen when it is loaded)"
)


@checked_flags
def retag(
    src: StrPath,
    dst: StrPath,
    *,
    mapping: Mapping[str, str],
    select: Select = None,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    in_place: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Rewrite the saved device tags of every storage (``{"cuda:1": "cpu"}``); bytes unchanged.

    Useful to make a GPU checkpoint load anywhere with plain ``torch.load``, or to make a
    CPU checkpoint look as if it was saved on a GPU (for tests). The output is a torch file.

    Args:
        src: the input.
        dst: the output (a torch file name: ``.pt``, ``.pth``, ``.bin``, ``.ckpt``).
        mapping: saved device tag -> new tag.
        select, allow_globals, force, in_place, verify, durable, dry_run, progress: as for
            :func:`rewrite`.

    Returns:
        The :class:`RewriteResult` (``device_map``: the tags rewritten).

    Raises:
        UsageError: ``mapping`` is not a dict of str; a tag that is not ``cpu``, ``cuda``,
            ``cuda:N``, ``mps`` or ``meta``; a ``.safetensors`` output (that format holds no
            device tags); no storage saved on a tag ``mapping`` names.
        And as :func:`rewrite`.

    Example:
        >>> retag("model.pt", "gpu1.pt", mapping={"cpu": "cuda:1"}).device_map
        {'cpu': 'cuda:1'}
    """
    mapping = str_mapping(mapping, "mapping", "a dict of saved tag -> new tag")
    # A saved tag may be any a file holds (a backend's own: npu:0, privateuseone:0), which
    # the rewrite checks the input for; a new one must be a tag plain torch.load restores.
    for tag in mapping.values():
        if not _DEVICE_TAG.fullmatch(tag):
            raise UsageError(
                f"device tag {tag!r} is not one torch restores: cpu or meta (no index), or "
                "cuda, mps, xpu or hpu with an optional :N (0 to 127, no leading zero)",
                argument="mapping",
            )
    # Device tags live only in torch's format: refused here, before the input is read.
    src, dst = checked_path(src, "src"), checked_path(dst, "dst")
    output_format_for(dst, "torch", "torch-zip", why=_DEVICE_TAGS_WHY)
    return rewrite(
        src,
        dst,
        device_map=dict(mapping),
        select=select,
        output_format="torch",
        allow_globals=allow_globals,
        force=force,
        in_place=in_place,
        verify=verify,
        durable=durable,
        dry_run=dry_run,
        progress=progress,
    )
