"""Which paths of an input folder decide what it reads as: the ones an output may never write.

By the folder's format, as :func:`~ckpt_tools.formats.detect.detect_format` tells it: a
Hugging Face folder's shards and index, a DCP folder's ``.metadata`` and ``*.distcp``, a
DeepSpeed folder's ``latest`` and rank files. A Hugging Face folder is also read through the
names its reader and ``from_pretrained`` look for, present or not
(:data:`~ckpt_tools.formats.hf_choice.TRANSFORMERS_ORDER`,
:data:`~ckpt_tools.formats.hf_choice.WEIGHT_FILES`, any ``*.index.json``, ``config.json`` and
the file its ``transformers_weights`` names): a new ``model.safetensors`` beside an index
would be loaded instead of it. Any other file there (a ``pytorch_model.bin`` that
``zero_to_fp32`` wrote into a DeepSpeed folder, a ``notes.txt``) is no input: an output may
replace it as it may replace any file (``--force``). A folder of no known format keeps
every file it holds.
"""

from __future__ import annotations

import fnmatch
import os

__all__ = ["shapes_reading"]

_READ_BY_FORMAT = {
    "hf-sharded": ("*.safetensors", "*.bin", "*.index.json"),
    "dcp": (".metadata", "*.distcp"),
    "deepspeed": ("latest", "*_model_states.pt", "*_optim_states.pt"),
}


def shapes_reading(folder: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Whether writing ``path`` (existing or not) could change what the input ``folder``
    reads as: the presence or content of that path is part of the folder's reading.

    Both the entry ``path`` names and, where it is a symlink, the file it points to count:
    writing through a link replaces its target.

    Args:
        folder: the input folder.
        path: the output path.

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
        form = detect_format(real_folder)
    except CheckpointError:
        form = None
    # The entry itself (its folder resolved), and what a symlink there points to.
    where, base = os.path.split(os.path.abspath(path))
    entry = os.path.join(os.path.realpath(where), base)
    for candidate in dict.fromkeys((entry, os.path.realpath(path))):
        if os.path.commonpath([real_folder, candidate]) != real_folder:
            continue
        name = os.path.basename(candidate)
        patterns = _READ_BY_FORMAT.get(form or "", ("*",))
        if os.path.lexists(candidate) and any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return True
        if form == "hf-sharded" and _hf_reads(real_folder, candidate):
            return True
    return False


def _hf_reads(folder: str, path: str) -> bool:
    """Whether a Hugging Face ``folder``'s reader (or ``from_pretrained``) looks for ``path``,
    present or not: its weight names, any index, ``config.json`` and the file that names."""
    from ckpt_tools.formats.hf_choice import TRANSFORMERS_ORDER, WEIGHT_FILES

    relative = os.path.relpath(path, folder)
    if relative in TRANSFORMERS_ORDER or relative in WEIGHT_FILES or relative == "config.json":
        return True
    if os.path.dirname(relative) == "" and relative.endswith(".index.json"):
        return True
    named = _named_weights(folder)
    return named is not None and os.path.normpath(named) == relative


def _named_weights(folder: str) -> str | None:
    """The file ``config.json`` names in ``transformers_weights``, present or not; None where
    it names none (or none that ``from_pretrained`` would accept)."""
    from ckpt_tools.errors import CheckpointError
    from ckpt_tools.formats.hf_choice import MAX_CONFIG_BYTES, explicit_weights

    config = os.path.join(folder, "config.json")
    try:
        if not os.path.isfile(config) or os.path.getsize(config) > MAX_CONFIG_BYTES:
            return None
        with open(config, "rb") as f:
            text = f.read()
        return explicit_weights(text, config, folder)
    except (OSError, CheckpointError):
        return None
