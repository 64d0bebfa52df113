"""A legacy (non-zip) file is read for every dtype exactly when torch reads it.

torch's legacy writer names an ``UntypedStorage`` for dtypes without a typed storage class
(float8, uint16, uint32, complex32), and its own reader then fails on the file; torch is the
oracle here, dtype by dtype.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import UnsupportedFormatError
from ckpt_tools.formats import open_checkpoint

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex32,
    torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_legacy_files_read_exactly_when_torch_reads_them(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    path = tmp_path / "legacy.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        torch.save({"w": torch.zeros(3, dtype=dtype)}, path, _use_new_zipfile_serialization=False)
    try:
        theirs = torch.load(path, weights_only=True)["w"]
    except AttributeError:  # "UntypedStorage has no attribute 'dtype'"
        theirs = None
    if theirs is None:
        with pytest.raises(UnsupportedFormatError, match="UntypedStorage"):
            open_checkpoint(path)
    else:
        ours = open_checkpoint(path).root["w"]
        assert ours.dtype == str(theirs.dtype).removeprefix("torch.")
        assert tuple(ours.shape) == tuple(theirs.shape)
