"""Hugging Face sharded folders: the shard planner and the folder writer.

The layout is ``huggingface_hub.save_torch_state_dict``'s: ``model-00001-of-0000N.safetensors``
files plus ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
{name: file}}``), or a lone ``model.safetensors`` (no index) when everything fits in one shard.
Tensors are split greedily in their order; a tensor larger than the limit gets a shard of its
own, as huggingface_hub's ``split_state_dict_into_shards_factory`` does.

The folder is written as a whole: every shard atomically
(:func:`~ckpt_tools.io.atomic.atomic_output`) and verified, inside a temp folder beside the
target, which is renamed into place only once all of it is complete. torch is never imported.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpt_tools.errors import OutputError, OutputExistsError, Remedy, UsageError
from ckpt_tools.formats.base import Checkpoint
from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.safetensors_writer import SafetensorsEntry, write_safetensors
from ckpt_tools.io.verify import Expected, verify_output

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "SHARD_PATTERN",
    "SIZE_UNITS",
    "ShardPlan",
    "check_output_folder",
    "index_bytes",
    "parse_shard_size",
    "plan_shards",
    "write_hf_shards",
]

#: huggingface_hub's default ``max_shard_size``.
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: Shard file names: ``suffix`` is ``-00001-of-00004``, or empty for a single file.
SHARD_PATTERN = "model{suffix}.safetensors"
#: The index beside the shards.
INDEX_NAME = "model.safetensors.index.json"
#: Units ``--max-shard-size`` accepts: decimal as huggingface_hub reads them ("5GB" is
#: 5*10**9), binary as transformers also accepts them ("5GiB" is 5*2**30).
SIZE_UNITS: Mapping[str, int] = {
    "TIB": 2**40,
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "TB": 10**12,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "B": 1,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
# Temp folders: not `.ckpt-tmp-` (atomic.py's file pattern, whose cleanup unlinks files).
_TEMP_DIR = re.compile(r"^\..*\.ckpt-tmpdir-(\d+)-[0-9a-f]+(?:-old)?$")
Progress = Callable[[int], None]


def parse_shard_size(value: str | int) -> int:
    """Bytes from a shard size: an int, ``"5GB"`` (10**9), ``"500MiB"`` (2**20), ``"1000"``.

    Args:
        value: the size; units are those of :data:`SIZE_UNITS`, case-insensitive.

    Returns:
        The size in bytes, at least 1.

    Raises:
        UsageError: not a positive size with a known unit.

    Example:
        >>> parse_shard_size("5GB"), parse_shard_size("5GiB"), parse_shard_size("1.5kb")
        (5000000000, 5368709120, 1500)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        match = _SIZE.match(str(value))
        unit = match.group(2).upper() if match else ""
        if match is None or (unit and unit not in SIZE_UNITS):
            raise UsageError(
                "expected a size like 5GB, 500MB or 2GiB "
                f"(units: {', '.join(u for u in SIZE_UNITS if u != 'B')})",
                argument="max_shard_size",
                value=repr(value),
                flag="--max-shard-size",
            )
        size = int(float(match.group(1)) * SIZE_UNITS[unit or "B"])
    if size < 1:
        raise UsageError(
            "must be at least 1 byte",
            argument="max_shard_size",
            value=repr(value),
            flag="--max-shard-size",
        )
    return size


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go into which file.

    Attributes:
        files: ``(file name, tensor names)`` in file order.
        total_size: bytes of tensor data over all files (the index's ``total_size``).
        max_shard_size: the limit the plan was made for, in bytes.
    """

    files: tuple[tuple[str, tuple[str, ...]], ...]
    total_size: int
    max_shard_size: int

    @property
    def is_sharded(self) -> bool:
        """More than one file: an index is written."""
        return len(self.files) > 1

    @property
    def weight_map(self) -> dict[str, str]:
        """Tensor name -> file name, in file order."""
        return {name: file for file, names in self.files for name in names}


def plan_shards(
    sizes: Sequence[tuple[str, int]], max_shard_size: int, pattern: str = SHARD_PATTERN
) -> ShardPlan:
    """Split tensors into shards greedily, in order, as huggingface_hub does.

    A tensor that would take the current shard over ``max_shard_size`` starts a new one; a
    tensor larger than the limit gets a shard of its own, placed where huggingface_hub places
    it (before the shard still being filled).

    Args:
        sizes: ``(name, nbytes)`` of every tensor, in output order.
        max_shard_size: the limit in bytes (see :func:`parse_shard_size`).
        pattern: file names, formatted with ``suffix``.

    Returns:
        The plan; one file named ``pattern.format(suffix="")`` when all fits in one.

    Example:
        >>> plan = plan_shards([("a", 6), ("b", 6), ("c", 2), ("d", 20)], 10)
        >>> [names for _, names in plan.files]
        [('a',), ('d',), ('b', 'c')]
        >>> plan.files[0][0], plan.total_size
        ('model-00001-of-00003.safetensors', 34)
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    for name, nbytes in sizes:
        total += nbytes
        if nbytes > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + nbytes > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return ShardPlan(((pattern.format(suffix=""), tuple(shards[0])),), total, max_shard_size)
    n = len(shards)
    files = tuple(
        (pattern.format(suffix=f"-{i + 1:05d}-of-{n:05d}"), tuple(names))
        for i, names in enumerate(shards)
    )
    return ShardPlan(files, total, max_shard_size)


def check_output_folder(
    dst: str | os.PathLike[str], src: str | os.PathLike[str] | None = None, force: bool = False
) -> Path:
    """Refuse an output folder that would clobber something, before any work is done.

    Args:
        dst: the output folder (it may exist empty).
        src: the input file or folder; never replaced, nor any folder holding it.
        force: replace an existing non-empty ``dst``.

    Returns:
        ``dst`` as an absolute path.

    Raises:
        OutputError: ``dst`` is ``src``, or holds it (never replaced, even with ``force``).
        OutputExistsError: ``dst`` exists, is not empty, and ``force`` is False.
        OutputError: ``dst`` is a file, or its parent folder does not exist.

    Example:
        >>> check_output_folder("sharded")
        Traceback (most recent call last):
        ckpt_tools.errors.OutputExistsError: output 'sharded' already exists; ...
    """
    out = Path(os.path.abspath(dst))
    if src is not None:
        real_src, real_out = os.path.realpath(src), os.path.realpath(out)
        if os.path.commonpath([real_src, real_out]) == real_out:
            raise OutputError(
                f"output folder {os.fspath(dst)!r} is the input or holds it ({os.fspath(src)!r}); "
                "it is never replaced",
                path=dst,
                remedies=(Remedy(text="choose another output folder"),),
            )
    if out.exists() and not out.is_dir():
        raise OutputError(
            f"output {os.fspath(dst)!r} is a file; a sharded output is a folder", path=dst
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputExistsError(dst)
    if not out.parent.is_dir():
        raise OutputError(
            f"the output's parent folder {str(out.parent)!r} does not exist; create it first",
            path=dst,
        )
    return out


def _dead_temp_dirs(parent: Path) -> None:
    """Remove temp folders a killed run left in ``parent`` (owner PID no longer running)."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            match = _TEMP_DIR.match(entry.name)
            if match is None:
                continue
            try:
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(entry, ignore_errors=True)
            except PermissionError:
                pass


@contextlib.contextmanager
def _published_folder(target: Path, durable: bool = True) -> Iterator[Path]:
    """A temp folder beside ``target`` that becomes ``target`` when the body succeeds.

    An existing ``target`` (checked by :func:`check_output_folder`) is moved aside first
    and removed only once the new folder has its name; on any error the temp folder goes.
    The folders are fsynced around the rename unless ``durable`` is False.
    """
    parent = target.parent
    _dead_temp_dirs(parent)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = parent / f".{target.name}.ckpt-tmpdir-{tag}"
    try:
        tmp.mkdir()
    except OSError as e:
        raise OutputError(f"cannot create a folder in {str(parent)!r}: {e.strerror}") from e
    try:
        yield tmp
        if durable:
            _fsync(tmp)
        old = parent / f".{target.name}.ckpt-tmpdir-{tag}-old"
        replaced = target.exists() and any(target.iterdir())
        if replaced:
            os.rename(target, old)
        try:
            os.rename(tmp, target)  # also replaces an empty folder
        except OSError:
            if replaced:
                os.rename(old, target)
            raise
        if durable:
            _fsync(parent)
        if replaced:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if isinstance(e, OutputError):
            raise
        raise OutputError(
            f"writing {str(target)!r} failed ({e.strerror or e}); the input is unchanged",
            path=str(target),
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def index_bytes(plan: ShardPlan, metadata: Mapping[str, str] | None = None) -> bytes:
    """The ``model.safetensors.index.json`` of ``plan`` (``json.dumps(indent=2)``, as the hub's).

    Args:
        plan: from :func:`plan_shards`.
        metadata: extra string entries for the index's ``metadata``, after ``total_size``.

    Returns:
        The file's bytes.

    Example:
        >>> plan = plan_shards([("a", 6), ("b", 6)], 10)
        >>> json.loads(index_bytes(plan))["weight_map"]["b"]
        'model-00002-of-00002.safetensors'
    """
    index = {
        "metadata": {"total_size": plan.total_size, **(metadata or {})},
        "weight_map": plan.weight_map,
    }
    return (json.dumps(index, indent=2) + "\n").encode()


def write_hf_shards(
    entries: Sequence[SafetensorsEntry],
    source: Checkpoint,
    dst: str | os.PathLike[str],
    plan: ShardPlan,
    *,
    metadata: Mapping[str, str] | None = None,
    verify: str = "sizes",
    progress: Progress | None = None,
    jobs: int = 1,
    durable: bool = True,
) -> tuple[str, ...]:
    """Write ``entries`` as the Hugging Face folder ``plan`` lays out, then publish it.

    Each shard's bytes are copied record by record from ``source`` by
    :func:`~ckpt_tools.io.safetensors_writer.write_safetensors` with ``{"format": "pt"}`` metadata.
    ``metadata`` (the dropped names of tied tensors, say) goes into the index when there
    is one, else into the single file, as huggingface_hub does.

    Args:
        entries: the tensors, every name of ``plan`` once.
        source: the checkpoint their bytes lie in.
        dst: the output folder, checked first with :func:`check_output_folder`.
        plan: from :func:`plan_shards` over these entries.
        metadata: extra string metadata.
        verify: ``sizes``, ``full`` or ``none``, for every shard.
        progress: called with the bytes written after each chunk (from several threads
            when ``jobs`` > 1).
        jobs: shards written at once, by threads. With more than one, a SIGTERM ends the
            process without cleanup: the shards' unnamed temp files vanish with it, and the
            next run in that folder removes the temp folder.
        durable: fsync every file and the folders (default); False skips those fsyncs
            (see :func:`~ckpt_tools.io.atomic.atomic_output`), unless a non-empty ``dst``
            is replaced.

    Returns:
        The files written (shards, then the index), names inside ``dst``.

    Raises:
        ConversionError: a dtype safetensors cannot hold.
        OutputError / VerificationError: writing or verifying failed; ``dst`` is untouched.

    Example:
        >>> from ckpt_tools.formats import open_checkpoint
        >>> ckpt = open_checkpoint("model.safetensors")
        >>> entries = [SafetensorsEntry(k, t) for k, t in ckpt.root.items()]
        >>> plan = plan_shards([(e.name, e.tensor.nbytes) for e in entries], 1000)
        >>> write_hf_shards(entries, ckpt, "model-hf", plan)[-1]
        'model.safetensors.index.json'
    """
    by_name = {e.name: e for e in entries}
    target = Path(os.path.abspath(dst))
    # A folder replaced by shards not yet on disk could be lost with them (as atomic_output).
    durable = durable or (target.is_dir() and any(target.iterdir()))
    extra = {str(k): str(v) for k, v in (metadata or {}).items()}
    shard_meta = {"format": "pt"} if plan.is_sharded else {**extra, "format": "pt"}
    with _published_folder(target, durable) as tmp:

        def write_one(item: tuple[str, tuple[str, ...]]) -> str:
            file, names = item
            shard = [by_name[n] for n in names]
            with atomic_output(tmp / file, durable=durable) as (f, tmp_path):
                write_safetensors(shard, source, f, shard_meta, progress)
                f.flush()
                expected = {e.name: e.tensor for e in shard}
                verify_output(str(tmp_path), Expected(expected, (), source), verify)
            return file

        if jobs > 1 and len(plan.files) > 1:
            # copy_file_range and fsync release the GIL: shards overlap their disk waits.
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(jobs, len(plan.files))) as pool:
                written = list(pool.map(write_one, plan.files))
        else:
            written = [write_one(item) for item in plan.files]
        if plan.is_sharded:
            with atomic_output(tmp / INDEX_NAME, durable=durable) as (f, _):
                f.write(index_bytes(plan, extra))
            written.append(INDEX_NAME)
    return tuple(written)
