"""Hugging Face style folders: ``*.index.json`` with a ``weight_map`` over shard files.

A folder is read as ``transformers``' ``from_pretrained`` reads it: through the file it would
load (see :func:`open_folder`); for an index, the ``weight_map``'s values say which shard
files to open, and every tensor of each of those files is read, whether the ``weight_map``
lists it or not (``accelerate``'s ``load_checkpoint_in_model`` and ``huggingface_hub``'s
``load_torch_model`` do the same). A shard file the index does not name is not read. A
name two named shards both hold is refused: the loaders disagree on which copy wins.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_tools._escape import shown
from ckpt_tools.descriptors import StorageRef, TensorRef
from ckpt_tools.errors import (
    CheckpointError,
    CorruptCheckpointError,
    Remedy,
    ResourceLimitError,
    quote_foreign,
)
from ckpt_tools.formats.base import Checkpoint, RangeSource
from ckpt_tools.formats.detect import check_regular, is_index_name
from ckpt_tools.formats.hf_choice import MAX_INDEX_BYTES, choose_weights
from ckpt_tools.formats.log import logger
from ckpt_tools.formats.safetensors import read_metadata, tied_aliases

__all__ = ["files_read", "open_folder", "open_index", "shard_path"]


def open_folder(path: str) -> Checkpoint:
    """Open a checkpoint folder: the weight file or index ``from_pretrained`` would load.

    That is the file config.json names in ``transformers_weights``, else the first of
    :data:`~ckpt_tools.formats.hf_choice.TRANSFORMERS_ORDER` present; failing those, the
    folder's one other ``*.index.json``, or its one other weight file
    (:func:`~ckpt_tools.formats.hf_choice.choose_weights`). A warning names the other weight
    files and indexes it holds, which are not read.

    Args:
        path: the folder.

    Returns:
        A ``hf-sharded`` :class:`Checkpoint` whose root maps every tensor name to its
        descriptor, with ``shards`` holding each shard's own checkpoint; for a single weight
        file, that file's own checkpoint (a rewrite keeps its format; ``inspect`` reports
        the folder, the file its one shard).

    Raises:
        UnsupportedFormatError: the folder holds no checkpoint, several indexes of which
            ``from_pretrained`` would load none, or a ``transformers_weights`` it refuses.
        CorruptCheckpointError: the index is malformed, or names missing shards or tensors.

    Example:
        >>> sorted(open_folder("sharded").shards)
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    from ckpt_tools.formats import open_checkpoint

    folder = Path(path)
    chosen, others = choose_weights(folder, path)
    if others:  # no notes on a Checkpoint: logged, as the tensors an index leaves out are
        msg = "%r: %s is read, as transformers' from_pretrained reads the folder; not read: %s"
        # Names read from the folder are escaped: a log line is text for people too.
        logger.warning(msg, path, shown(chosen), ", ".join(map(shown, others)))
    if is_index_name(chosen):
        return open_index(str(folder / chosen))
    return open_checkpoint(shard_path(str(folder), chosen, path))


def _allowed_roots(folder: str) -> tuple[str, ...]:
    """Where a shard may resolve: the folder, and in a Hugging Face cache its blob store.

    A hub cache snapshot (``models--org--name/snapshots/REV/``) holds symlinks to
    ``models--org--name/blobs/HASH``; refusing those would refuse every cached model.
    """
    real = os.path.realpath(folder or ".")
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        return real, os.path.join(os.path.dirname(parent), "blobs")
    return (real,)


def shard_path(folder: str, name: str, named_by: str) -> str:
    """The path of the shard file ``name`` in ``folder``, refused if it leads out of it.

    An index is data from whoever made the checkpoint: a shard name that is absolute, climbs
    out with ``..``, or is a symlink resolving outside the folder would make us open (and
    quote the first bytes of) any file on the machine.

    Args:
        folder: the folder the index (or weight file) lies in.
        name: the shard's file name as the index gives it.
        named_by: the index (or folder) that names it, for the message.

    Returns:
        ``folder/name``.

    Raises:
        CorruptCheckpointError: the name is not a plain relative path inside ``folder``, or
            resolves outside it.

    Example:
        >>> shard_path("llama", "model-00001-of-00002.safetensors", "llama/x.index.json")
        'llama/model-00001-of-00002.safetensors'
    """
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or ".." in parts or "\0" in name:
        raise CorruptCheckpointError(
            f"{named_by!r} names shard {name!r}, which is not a file name inside its folder; "
            "shards must lie beside the index",
            path=named_by,
        )
    where = os.path.join(folder, name)
    real = os.path.realpath(where)
    if not any(os.path.commonpath([real, root]) == root for root in _allowed_roots(folder)):
        raise CorruptCheckpointError(
            f"{named_by!r} names shard {name!r}, a symlink that leads out of its folder "
            f"(to {real!r}); shards must lie inside the folder",
            path=named_by,
            remedies=(
                Remedy(
                    text="copy the files it links to into the folder, or open a linked file "
                    "by its own path"
                ),
            ),
        )
    return where


def open_index(
    index_path: str,
    *,
    source: RangeSource | None = None,
    open_shard: Callable[[str], Checkpoint] | None = None,
) -> Checkpoint:
    """Open the shards an ``*.index.json`` names, which lie beside it.

    ``open_checkpoint("FOLDER/model.safetensors.index.json")`` comes here: it is how to pick
    one index in a folder that holds several.

    Args:
        index_path: the index file (its URL where ``source`` is given).
        source: the index read by ranges (a remote file); None reads ``index_path``.
        open_shard: opens a shard by the file name the index gives it (remote shards);
            None opens the file of that name beside a local index.

    Returns:
        The same ``hf-sharded`` :class:`Checkpoint` as :func:`open_folder` of its folder
        (its ``path`` is that folder).

    Raises:
        CorruptCheckpointError: the index is malformed, names missing shards or tensors, or
            two of its shards hold the same name.

    Example:
        >>> ckpt = open_index("sharded/model.safetensors.index.json")
        >>> sorted(ckpt.shards)
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    index, weight_map = _read_index(index_path, source)
    if open_shard is None:
        shards = _open_shards(index_path, weight_map)
    else:
        shards = {shard: open_shard(shard) for shard in dict.fromkeys(weight_map.values())}
    root: dict[str, TensorRef] = {}
    owner: dict[int, Checkpoint] = {}
    storages: dict[str, StorageRef] = {}
    for name, shard in _place_tensors(index_path, weight_map, shards).items():
        tensor = shards[shard].root[name]
        root[name] = tensor
        owner[id(tensor.storage)] = shards[shard]
        storages[f"{shard}:{tensor.storage.key}"] = tensor.storage

    # Writers re-type the storages of tensors read without a pickle (a copy with a storage
    # class, same key): a safetensors shard's keys are its tensor names, which the index
    # keeps unique across shards. A torch shard's keys ("0", "1") are not: never by key.
    by_key = {t.storage.key: owner[id(t.storage)] for t in root.values() if t.func is None}
    metadata = index.get("metadata") if isinstance(index.get("metadata"), dict) else None
    aliases = tied_aliases(root, metadata, index_path)
    root.update((alias, root[kept]) for alias, kept in aliases.items())
    metadata = read_metadata(metadata, aliases)

    def shard_of(storage: StorageRef) -> Checkpoint:
        shard = owner.get(id(storage)) or by_key.get(storage.key)
        if shard is None:
            raise KeyError(f"storage {storage.key!r} is not one of {index_path!r}'s")
        return shard

    unsafe = tuple(dict.fromkeys(g for c in shards.values() for g in c.unsafe_globals))
    return Checkpoint(
        path=(os.path.dirname(index_path) or ".")
        if source is None
        else index_path.rsplit("/", 1)[0],
        format="hf-sharded",
        root=root,
        storages=storages,
        unsafe_globals=unsafe,
        metadata=metadata,
        shards=shards,
        locate=lambda storage: shard_of(storage).span(storage),
        probe=lambda storage: shard_of(storage).check_span(storage),
    )


def files_read(folder: Path) -> set[str] | None:
    """The files a Hugging Face folder's reading opens: ``config.json``, the file
    :func:`~ckpt_tools.formats.hf_choice.choose_weights` chooses and, for an index, the
    shards its ``weight_map`` names.

    Args:
        folder: the folder.

    Returns:
        Names relative to ``folder``; None where that cannot be told (no checkpoint chosen,
        an index this reader refuses): every weight file may then be read.

    Example:
        >>> sorted(files_read(Path("sharded")))[:2]
        ['config.json', 'model-00001-of-00002.safetensors']
    """
    try:
        chosen = choose_weights(folder, str(folder))[0]
    except CheckpointError:  # (a weight file that is a link to nothing too)
        return None
    read = {"config.json", chosen}
    if not is_index_name(chosen):
        return read
    index = folder / chosen
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            return None
        _, weight_map = _read_index(str(index))
    except (OSError, CheckpointError):
        return None
    base = posixpath.dirname(chosen)
    return read | {posixpath.normpath(posixpath.join(base, v)) for v in weight_map.values()}


def _index_text(index_path: str, source: RangeSource | None) -> str:
    if source is None:
        check_regular(index_path)  # a FIFO named *.index.json found by a folder's glob
        with open(index_path, encoding="utf-8") as f:
            return f.read()
    if source.size > MAX_INDEX_BYTES:
        raise ResourceLimitError(
            f"{index_path!r}: a shard index of {source.size} bytes is over the "
            f"{MAX_INDEX_BYTES >> 20} MiB limit",
            path=index_path,
        )
    return source.pread(source.size, 0).decode("utf-8")


def _read_index(
    index_path: str, source: RangeSource | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's JSON and its ``weight_map`` (tensor name -> shard file name), checked."""
    try:
        index = json.loads(_index_text(index_path, source))
        weight_map = index["weight_map"]
    except RecursionError as e:
        raise CorruptCheckpointError(
            f"{index_path!r} is not a valid shard index: its JSON nests too deeply", path=index_path
        ) from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(
            f"{index_path!r} is not a valid shard index ({quote_foreign(e)})"
        ) from e
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(
            f"{index_path!r} is not a valid shard index: its weight_map must map tensor names "
            "to shard file names"
        )
    return index, weight_map


def _open_shards(index_path: str, weight_map: dict[str, str]) -> dict[str, Checkpoint]:
    """Each shard the index names, opened, in the order it first names them."""
    from ckpt_tools.formats import open_checkpoint

    folder = os.path.dirname(index_path)
    shards: dict[str, Checkpoint] = {}
    for shard in dict.fromkeys(weight_map.values()):
        where = shard_path(folder, shard, index_path)
        if not os.path.lexists(where):
            raise CorruptCheckpointError(
                f"{index_path!r} names shard {shard!r}, which is missing from {folder!r}"
            )
        shards[shard] = open_checkpoint(where)
    return shards


def _holders(index_path: str, shards: Mapping[str, Checkpoint]) -> dict[Any, str]:
    """Each name the named shards hold -> the shard holding it; a name held twice refused.

    ``from_pretrained`` and ``load_checkpoint_in_model`` load the shards in sorted order, so
    the last copy wins; ``load_torch_model`` loads them in set order, so any copy may win.
    """
    holder: dict[Any, str] = {}
    twice: list[str] = []
    for shard, ckpt in shards.items():
        for name in ckpt.root if isinstance(ckpt.root, Mapping) else ():
            if name in holder:
                twice.append(f"{name!r} ({holder[name]} and {shard})")
            holder.setdefault(name, shard)
    if twice:
        raise CorruptCheckpointError(
            f"{index_path!r} names shards that hold the same tensor: {_listing(twice)}; "
            "Hugging Face loaders disagree on which copy they load, so neither is read",
            path=index_path,
        )
    return holder


def _place_tensors(
    index_path: str, weight_map: Mapping[str, str], shards: Mapping[str, Checkpoint]
) -> dict[str, str]:
    """Where each tensor of an index's folder lies, as ``transformers`` loads the folder.

    ``from_pretrained`` opens the shard files the ``weight_map`` names and loads every tensor
    each holds: one the ``weight_map`` leaves out is loaded too, and one it places in the
    wrong shard is loaded from the shard that holds it. Both are logged as warnings (as
    ``huggingface_hub`` logs the first), since a tool that trusts the ``weight_map`` would
    lose them.

    Args:
        index_path: the index, for messages.
        weight_map: tensor name -> shard file name, as the index gives it.
        shards: each shard the index names, opened.

    Returns:
        Tensor name -> the shard holding it: the ``weight_map``'s names in its order, then
        the names it leaves out, in shard and file order.

    Raises:
        CorruptCheckpointError: a name the ``weight_map`` lists that no named shard holds as a
            tensor, a name two named shards hold, or an entry it leaves out that is no tensor.
    """
    holder = _holders(index_path, shards)
    placed: dict[str, str] = {}
    absent: list[str] = []
    for name, shard in weight_map.items():
        found = holder.get(name)
        if found is None or not isinstance(shards[found].root[name], TensorRef):
            absent.append(f"{name!r} in {shard!r}")
        else:
            placed[name] = found
    unlisted = {n: s for n, s in holder.items() if n not in weight_map}
    odd = [n for n, s in unlisted.items() if not _is_tensor_entry(n, shards[s].root[n])]
    if absent or odd:
        what = (
            f"places {_listing(absent)}, but that shard has no such tensor (nor does "
            "any other shard it names)"
            if absent
            else f"does not list entries its shards hold that are no tensors: "
            f"{_listing([repr(n) for n in odd])}"
        )
        raise CorruptCheckpointError(f"{index_path!r} {what}", path=index_path)
    _note(index_path, unlisted, {n: s for n, s in placed.items() if s != weight_map[n]})
    return {**placed, **unlisted}


def _is_tensor_entry(name: Any, value: Any) -> bool:
    return isinstance(name, str) and isinstance(value, TensorRef)


def _listing(items: list[str]) -> str:
    """The first few items, and how many more."""
    more = f" and {len(items) - 5} more" if len(items) > 5 else ""
    return ", ".join(items[:5]) + more


def _note(index_path: str, unlisted: Mapping[str, str], moved: Mapping[str, str]) -> None:
    """Warn of the tensors read although the ``weight_map`` leaves them out or misplaces them."""
    if unlisted:
        logger.warning(
            "%r does not list %d tensor(s) its shards hold; they are read, as transformers "
            "loads them: %s",
            index_path,
            len(unlisted),
            _listing([f"{n!r} ({shown(s)})" for n, s in unlisted.items()]),
        )
    if moved:
        logger.warning(
            "%r places %d tensor(s) in a shard that does not hold them; they are read from "
            "the shard that does, as transformers loads them: %s",
            index_path,
            len(moved),
            _listing([f"{n!r} ({shown(s)})" for n, s in moved.items()]),
        )
