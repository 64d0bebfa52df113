"""Which paths of an input folder decide what it reads as: the ones an output may never write.

By the folder's format, as :func:`~ckpt_tools.formats.detect.detect_format` tells it: a
Hugging Face folder's shards and index, a DCP folder's ``.metadata`` and ``*.distcp``, a
DeepSpeed folder's ``latest`` and rank files. In a Hugging Face folder, a new file that
``from_pretrained`` would choose before the file it loads now
(:func:`~ckpt_tools.formats.hf_choice.choose_weights`) changes the reading too, as
``config.json`` may: a new ``model.safetensors`` beside an index would be loaded instead of
it, where a new ``pytorch_model.bin`` beside ``model.safetensors`` is never read. Any other
file there (a ``pytorch_model.bin`` that ``zero_to_fp32`` wrote into a DeepSpeed folder, a
``notes.txt``) is no input: an output may replace it as it may replace any file
(``--force``). A folder of no known format keeps
every file it holds.
"""

from __future__ import annotations

import fnmatch
import os

__all__ = ["shapes_reading"]

_READ_BY_FORMAT = {
    "hf-sharded": ("*.safetensors", "*.bin", "*.index.json", "*.index.*.json"),
    "dcp": (".metadata", "*.distcp"),
    "deepspeed": ("latest", "*_model_states.pt", "*_optim_states.pt"),
}


def shapes_reading(
    folder: str | os.PathLike[str], path: str | os.PathLike[str], *, form: str | None = None
) -> bool:
    """Whether writing ``path`` (existing or not) could change what the input ``folder``
    reads as: the presence or content of that path is part of the folder's reading.

    Both the entry ``path`` names and, where it is a symlink, the file it points to count:
    writing through a link replaces its target.

    Args:
        folder: the input folder.
        path: the output path.
        form: the folder's format where the caller knows it (detected otherwise).

    Returns:
        True where an output must not be written at ``path``.

    Example:
        >>> os.makedirs("run", exist_ok=True)
        >>> _ = open("run/.metadata", "wb"), open("run/__0_0.distcp", "wb")
        >>> shapes_reading("run", "run/__0_0.distcp"), shapes_reading("run", "run/notes.txt")
        (True, False)
    """
    from ckpt_tools.errors import CheckpointError
    from ckpt_tools.formats.detect import detect_format

    real_folder = os.path.realpath(folder)
    try:
        form = form or detect_format(real_folder)
    except CheckpointError:
        form = None
    # The entry itself (its folder resolved), and what a symlink there points to.
    where, base = os.path.split(os.path.abspath(path))
    entry = os.path.join(os.path.realpath(where), base)
    for candidate in dict.fromkeys((entry, os.path.realpath(path))):
        if os.path.commonpath([real_folder, candidate]) != real_folder:
            continue
        if os.path.lexists(candidate) and _read_now(real_folder, form, candidate):
            return True
        if form == "hf-sharded" and _hf_reads(real_folder, candidate):
            return True
    return form != "hf-sharded" and os.path.realpath(path) in _linked_reads(real_folder, form)


def _linked_reads(folder: str, form: str | None) -> set[str]:
    """The files a DCP or DeepSpeed ``folder`` reads that lie elsewhere, reached through a
    linked subfolder (a tag folder on another volume), by their real paths: such a file is
    no less an input than one inside the folder."""
    found: set[str] = set()
    with os.scandir(folder) as entries:
        linked = [e.path for e in entries if e.is_symlink() and e.is_dir()]
    for sub in linked:
        try:
            names = os.listdir(sub)
        except OSError:  # (a folder the reader cannot list either)
            continue
        found.update(
            os.path.realpath(os.path.join(sub, name)) for name in names if _named_read(name, form)
        )
    return found


def _named_read(name: str, form: str | None) -> bool:
    """Whether a file ``name`` is one its folder's format reads (any, where none is known)."""
    return any(fnmatch.fnmatchcase(name, p) for p in _READ_BY_FORMAT.get(form or "", ("*",)))


def _read_now(folder: str, form: str | None, path: str) -> bool:
    """Whether the existing file ``path`` is read by the folder's reader: in a Hugging Face
    folder the files it opens, else the files its format's patterns name."""
    from pathlib import Path

    from ckpt_tools.formats.hf import files_read

    read = files_read(Path(folder)) if form == "hf-sharded" else None
    if read is not None:
        return os.path.relpath(path, folder) in read
    return _named_read(os.path.basename(path), form)


def _hf_reads(folder: str, path: str) -> bool:
    """Whether writing ``path`` in a Hugging Face ``folder`` changes the file its reader (and
    ``from_pretrained``) loads: ``config.json`` (it may name the weights), or a name that,
    once present, is chosen before the file chosen now (a ``model.safetensors`` beside an
    index). A name chosen after it (a ``pytorch_model.bin`` beside ``model.safetensors``) is
    never read."""
    from pathlib import Path

    from ckpt_tools.errors import CheckpointError
    from ckpt_tools.formats.hf_choice import choose_weights

    relative = os.path.relpath(path, folder)
    if relative == "config.json":
        return True
    try:
        now: str | None = choose_weights(Path(folder), folder)[0]
    except CheckpointError:
        now = None  # nothing loads now (the file config.json names is missing)
    try:
        then: str | None = choose_weights(Path(folder), folder, adding=relative)[0]
    except CheckpointError:
        then = None  # several indexes of which none wins: the reading changes too
    return now != then
