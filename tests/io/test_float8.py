"""float8 widened to float32 against torch's own ``tensor.float()``, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpt_tools.dtypes import FLOATING
from ckpt_tools.io.casting import cast_chunk
from ckpt_tools.io.float8 import FLOAT8_DTYPES, float8_to_float32


def test_the_formats_are_torchs_floating_float8_dtypes() -> None:
    torch_floating = {
        str(d).removeprefix("torch.")
        for d in vars(torch).values()
        if isinstance(d, torch.dtype) and d.is_floating_point
    }
    # The packed float4 counts as floating for torch, which has no cast for it.
    assert set(FLOATING) == torch_floating - {"float4_e2m1fn_x2"}
    assert set(FLOAT8_DTYPES) == {d for d in torch_floating if d.startswith("float8_")}


@pytest.mark.parametrize("dtype", FLOAT8_DTYPES)
def test_every_bit_pattern_widens_as_torch_widens_it(dtype: str) -> None:
    every = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(every).view(getattr(torch, dtype)).float()
    got = float8_to_float32(every, dtype)
    assert got.dtype == np.uint32
    assert np.array_equal(got, want.view(torch.int32).numpy().view(np.uint32))
    # Streamed as cast records stream it: any chunk, any first element.
    raw = np.tile(every, 3)[5:700].tobytes()
    streamed = np.frombuffer(cast_chunk(raw, dtype, "float32", 5, 768), np.uint32)
    assert np.array_equal(streamed, np.tile(got, 3)[5:700])


def test_other_dtypes_and_narrowing_are_refused() -> None:
    with pytest.raises(ValueError, match="float4_e2m1fn_x2 is not a float8 format"):
        float8_to_float32(np.zeros(2, np.uint8), "float4_e2m1fn_x2")
    with pytest.raises(ValueError, match="cannot cast float8_e4m3fn to bfloat16"):
        cast_chunk(b"\0\0", "float8_e4m3fn", "bfloat16", 0, 2)
