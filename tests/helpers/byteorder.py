"""Torch zips as a big-endian machine's torch.save writes them, made from a little-endian one.

torch.save writes ``sys.byteorder`` in the byteorder record and each storage's elements in
the machine's order; torch.load byte-swaps each storage by its dtype where the record names
the other order (a complex element as its two halves). So a big-endian file is the same
archive with the record saying ``big`` and every storage's elements swapped.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from ckpt_tools.dtypes import itemsize
from ckpt_tools.formats import open_checkpoint
from tests.helpers.committed import tools


def big_endian_copy(src: Path, dst: Path) -> Path:
    """``src`` (a little-endian torch zip) as a big-endian machine would have saved it."""
    storages = open_checkpoint(src).storages
    replace = {"byteorder": b"big"}
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
        for key, storage in storages.items():
            data = z.read(f"{root}/data/{key}")
            size = itemsize(storage.dtype) // (2 if storage.dtype.startswith("complex") else 1)
            if size > 1:
                data = np.frombuffer(data, dtype=f"<u{size}").byteswap().tobytes()
            replace[f"data/{key}"] = data
    tools().rewrite_zip(src, dst, replace=replace)
    return dst
