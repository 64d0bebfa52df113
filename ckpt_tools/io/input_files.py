"""Which files of an input folder its reader reads: the ones an output may never replace.

By the folder's format, as :func:`~ckpt_tools.formats.detect.detect_format` tells it: a
Hugging Face folder's shards and index, a DCP folder's ``.metadata`` and ``*.distcp``, a
DeepSpeed folder's ``latest`` and rank files. Any other file there (a ``pytorch_model.bin``
that ``zero_to_fp32`` wrote into a DeepSpeed folder, a ``config.json``) is no input: an output
may replace it as it may replace any file (``--force``). A folder of no known format keeps
every file.
"""

from __future__ import annotations

import fnmatch
import os

__all__ = ["reads"]

_READ_BY_FORMAT = {
    "hf-sharded": ("*.safetensors", "*.bin", "*.index.json"),
    "dcp": (".metadata", "*.distcp"),
    "deepspeed": ("latest", "*_model_states.pt", "*_optim_states.pt"),
}


def reads(folder: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Whether ``path``, an existing file, is one the reader of the input ``folder`` reads.

    Example:
        >>> os.makedirs("run", exist_ok=True)
        >>> _ = open("run/.metadata", "wb"), open("run/__0_0.distcp", "wb")
        >>> reads("run", "run/__0_0.distcp"), reads("run", "run/notes.txt")
        (True, False)
    """
    from ckpt_tools.errors import CheckpointError
    from ckpt_tools.formats.detect import detect_format

    real_folder, real = os.path.realpath(folder), os.path.realpath(path)
    if os.path.commonpath([real_folder, real]) != real_folder:
        return False
    try:
        patterns = _READ_BY_FORMAT.get(detect_format(real_folder), ("*",))
    except CheckpointError:
        patterns = ("*",)
    name = os.path.basename(real)
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)
