"""Which file of a Hugging Face folder ``from_pretrained`` loads, and the others it leaves.

``transformers`` first takes the file ``config.json`` names in ``transformers_weights``, where
it names one; otherwise the first of :data:`TRANSFORMERS_ORDER` present. A folder with none
of those is read through its one other index or weight file, a variant's
(``model.fp16.safetensors``) included.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from ckpt_tools._escape import shell_word
from ckpt_tools.errors import Remedy, UnsupportedFormatError, quote_foreign
from ckpt_tools.formats.detect import is_index_name
from ckpt_tools.formats.missing import dangling

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_INDEX_BYTES",
    "TRANSFORMERS_ORDER",
    "WEIGHT_FILES",
    "choose_weights",
    "explicit_weights",
]

_ST, _PT = "model.safetensors", "pytorch_model.bin"
WEIGHT_FILES = (_ST, _PT, "adapter_model.safetensors", "adapter_model.bin")
WEIGHT_FILES += ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
# The files ``from_pretrained`` looks for in a local folder, in the order it tries them
# (``use_safetensors`` at its default): it loads the first present and ignores the rest.
TRANSFORMERS_ORDER = (_ST, f"{_ST}.index.json", _PT, f"{_PT}.index.json")

#: A model's config.json is a few KB; one far larger is not read for its weights entry.
MAX_CONFIG_BYTES = 16 << 20
#: An index names each tensor once: a few MB for the largest models. A remote index that
#: declares more is refused before it is fetched.
MAX_INDEX_BYTES = 64 << 20
# What from_pretrained accepts as ``transformers_weights``; it raises on anything else.
_EXPLICIT_SUFFIXES = (".safetensors", ".safetensors.index.json")
_EXPLICIT_NAMES = ("adapter_model.bin",)
# transformers' four files of a variant, in the order from_pretrained(variant=) tries them.
_VARIANT_ORDER = tuple(
    re.compile(pattern)
    for pattern in (
        r"model\.(.+)\.safetensors",
        r"model\.safetensors\.index\.(.+)\.json",
        r"pytorch_model\.(.+)\.bin",
        r"pytorch_model\.bin\.index\.(.+)\.json",
    )
)
# A variant's shard: model.fp16-00001-of-00002.safetensors.
_SHARD_SUFFIX = re.compile(r"-\d+-of-\d+$")


def choose_weights(folder: Path, path: str, *, adding: str | None = None) -> tuple[str, list[str]]:
    """The file ``from_pretrained`` would load from ``folder`` (else its one checkpoint), and
    the other weight files and indexes the folder holds, which are not read.

    Args:
        folder: the folder.
        path: the folder as the caller named it, for messages.
        adding: a name inside the folder taken as present (an output about to be written
            there), to tell whether writing it changes the choice.

    Returns:
        ``(chosen, others)``: names relative to ``folder``.

    Raises:
        UnsupportedFormatError: the folder holds no checkpoint; several indexes of which
            ``from_pretrained`` would load none; or a ``transformers_weights`` entry that
            ``from_pretrained`` refuses, or that names a file the folder does not hold.

    Example:
        >>> choose_weights(Path("sharded"), "sharded")
        ('model.safetensors.index.json', [])
    """

    def present(name: str) -> bool:
        return name == adding or (folder / name).is_file()

    explicit = _explicit_weights(folder, path, present)
    held = sorted(os.listdir(folder))  # listed once: indexes, variants and the refusals
    found = [n for n in TRANSFORMERS_ORDER if present(n)]
    listed = {n for n in held if is_index_name(n) and not n.startswith(".")}
    listed |= {adding} if adding is not None and is_index_name(adding) else set()
    indexes = [n for n in sorted(listed) if n not in found and "/" not in n]
    singles = [n for n in WEIGHT_FILES if n not in found and present(n)]
    names = {*held, adding} if adding is not None else set(held)
    variants = _variants([n for n in names if _is_variant(n) and present(n)])
    if explicit is not None:
        return explicit, [n for n in found + indexes + singles + variants if n != explicit]
    ordered = None if found or singles else _one_variant(indexes + variants)
    if ordered is not None:
        return ordered[0], ordered[1:]
    if not found and len(indexes) > 1:
        first = str(folder / indexes[0])
        advice = Remedy(
            "path", repr(first), flag=shell_word(first), verb="open the one you mean, e.g."
        )
        raise UnsupportedFormatError(
            f"{path!r} holds several indexes ({', '.join(indexes)})", path=path, remedies=(advice,)
        )
    if not found and not indexes and len(singles or variants) > 1:
        _refuse_other_kinds(singles or variants, folder, path)
    if not found and not indexes and not singles and not variants:
        from ckpt_tools.formats.dcp.layout import refuse_without_metadata

        refuse_without_metadata(held, path)  # a DCP folder's files, not a Hugging Face one
        nothing = dangling(str(folder), (*TRANSFORMERS_ORDER, *WEIGHT_FILES))
        if nothing is not None:  # a hub snapshot whose weights never arrived
            raise nothing
        listing = ", ".join(held[:10]) or "nothing"
        raise UnsupportedFormatError(
            f"{path!r} is a folder without a checkpoint: expected a *.index.json with its shards "
            f"or one of {', '.join(WEIGHT_FILES[:3])} (or a variant's: model.fp16.safetensors); "
            f"it holds: {listing}",
            path=path,
        )
    names = found + indexes + singles + variants
    return names[0], names[1:]


def _one_variant(names: Sequence[str]) -> list[str] | None:
    """``names``, where they are all transformers' files of one variant, in the order
    ``from_pretrained(variant=)`` tries them; else None."""
    placed = []
    for name in names:
        found = [(i, p.fullmatch(name)) for i, p in enumerate(_VARIANT_ORDER)]
        hits = [(i, m.group(1)) for i, m in found if m is not None]
        if not hits:
            return None
        placed.append((*hits[0], name))
    if len({variant for _, variant, _ in placed}) != 1:
        return None
    return [name for _, _, name in sorted(placed)]


def _variants(found: Sequence[str]) -> list[str]:
    """The folder's variant weight files (``save_pretrained(variant="fp16")`` names the file
    ``model.fp16.safetensors``; diffusers ``diffusion_pytorch_model.fp16.safetensors``), each
    kind's ``.safetensors`` first, as ``from_pretrained(variant=)`` prefers it. Shards are
    left out (:func:`_is_variant`): a variant's shards are read through its index."""
    return sorted(found, key=lambda n: (_kind(n), not n.endswith(".safetensors")))


def _is_variant(name: str) -> bool:
    """Whether ``name`` is one of :data:`WEIGHT_FILES` with a variant before its suffix."""
    for fixed in WEIGHT_FILES:
        stem, _, suffix = fixed.rpartition(".")
        middle = name[len(stem) + 1 : -len(suffix) - 1]
        if name.startswith(f"{stem}.") and name.endswith(f".{suffix}") and middle:
            return _SHARD_SUFFIX.search(middle) is None
    return False


def _kind(name: str) -> str:
    """A weight file's name without its suffix, a transformers ``.bin``'s as its
    ``.safetensors``'s: the two formats of one checkpoint."""
    stem = name.rpartition(".")[0]
    return stem.removeprefix("pytorch_") if stem.startswith("pytorch_model") else stem


def _refuse_other_kinds(singles: Sequence[str], folder: Path, path: str) -> None:
    """Weight files of one kind (an adapter's, a diffusers model's, one variant's) in both
    formats are read as PEFT, diffusers and ``from_pretrained(variant=)`` read them, the
    ``.safetensors`` first (it comes first in ``singles``); files of two kinds are refused,
    each named.

    Raises:
        UnsupportedFormatError: the files are of more than one kind.
    """
    if len({_kind(name) for name in singles}) == 1:
        return
    first = str(folder / singles[0])
    raise UnsupportedFormatError(
        f"{path!r} holds several weight files of different kinds or variants "
        f"({', '.join(singles)}); which one to read is not told by the folder",
        path=path,
        remedies=(
            Remedy("path", repr(first), flag=shell_word(first), verb="open the one you mean, e.g."),
        ),
    )


def _explicit_weights(folder: Path, path: str, present: Callable[[str], bool]) -> str | None:
    """The file ``config.json``'s ``transformers_weights`` names, where it names one that
    the folder holds (``present`` says)."""
    config = folder / "config.json"
    try:
        if not config.is_file() or config.stat().st_size > MAX_CONFIG_BYTES:
            return None
        text = config.read_bytes()
    except OSError:
        return None
    name = explicit_weights(text, str(config), path)
    if name is not None and not present(name):
        raise UnsupportedFormatError(
            f"{str(config)!r} names transformers_weights {quote_foreign(repr(name))}, which the "
            "folder does not hold; from_pretrained loads that file and no other",
            path=path,
        )
    return name


def explicit_weights(config: bytes, config_name: str, path: str) -> str | None:
    """The weights file a ``config.json`` names in ``transformers_weights``, checked as
    ``from_pretrained`` checks it; None where it names none.

    A config that is no JSON object is passed over: ``from_pretrained`` fails on it before
    it looks for weights, and the folder may be another library's.

    Args:
        config: the bytes of ``config.json``.
        config_name: its path or URL, for messages.
        path: the folder as the caller named it, for the error.

    Returns:
        The name, relative to the folder; None where the config names none.

    Raises:
        UnsupportedFormatError: ``from_pretrained`` refuses the entry: not a
            ``*.safetensors`` file or ``*.safetensors.index.json``, or outside the folder.

    Example:
        >>> explicit_weights(b'{"transformers_weights": "ema.safetensors"}', "config.json", ".")
        'ema.safetensors'
    """
    try:
        entries = json.loads(config)
    except ValueError:
        return None
    if not isinstance(entries, dict) or entries.get("transformers_weights") is None:
        return None
    name = entries["transformers_weights"]
    shown = f"{config_name!r} names transformers_weights {quote_foreign(repr(name))}"
    if not isinstance(name, str) or not (
        name.endswith(_EXPLICIT_SUFFIXES) or name in _EXPLICIT_NAMES
    ):
        raise UnsupportedFormatError(
            f"{shown}; from_pretrained loads only a *.safetensors file or a "
            "*.safetensors.index.json there, and refuses this folder",
            path=path,
        )
    inside = posixpath.normpath(name.replace("\\", "/"))
    if "\0" in name or posixpath.isabs(inside) or inside.split("/")[0] == "..":
        raise UnsupportedFormatError(
            f"{shown}, which is outside the folder; from_pretrained refuses it", path=path
        )
    return name
