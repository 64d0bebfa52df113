"""Converting views to safetensors never imports torch, and stores what safetensors would.

The conversion runs in a subprocess whose ``PYTHONPATH`` starts with a fake ``torch`` that
raises on import, so any torch import fails the run. Its output is compared, tensor by
tensor, with what ``safetensors.torch.save_file`` stores for ``tensor.contiguous()``.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def views() -> dict[str, torch.Tensor]:
    """Non-contiguous views of every kind, and a few contiguous neighbours."""
    base = torch.arange(24, dtype=torch.float32)
    big = torch.arange(1536 * 1536, dtype=torch.float32).view(1536, 1536)  # 9 MiB
    return {
        "transposed": base.view(4, 6).t(),
        "expanded": base[:3].view(3, 1).expand(3, 4),
        "stepped_at_offset": base[5::4],
        "permuted": base.view(2, 3, 4).permute(2, 0, 1),
        "block": base.view(4, 6)[1:3, 2:5],
        "bf16_transposed": torch.arange(12, dtype=torch.bfloat16).view(3, 4).t(),
        "f16_stepped": torch.arange(10, dtype=torch.float16)[::3],
        "i64_transposed": torch.arange(6).view(2, 3).t(),
        "bool_stepped": (torch.arange(9) % 2 == 0)[::2],
        "u8_transposed": torch.arange(12, dtype=torch.uint8).view(3, 4).t(),
        "i32_permuted": torch.arange(24, dtype=torch.int32).view(2, 3, 4).permute(1, 2, 0),
        "contiguous_slice": base[2:8],
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "big_transposed": big.t(),  # more than one 8 MiB piece
    }


def tensor_bytes(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, data bytes) of a safetensors file, read from its header."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header: dict[str, Any] = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    start = 8 + length
    return {
        name: (
            e["dtype"],
            e["shape"],
            data[start + e["data_offsets"][0] : start + e["data_offsets"][1]],
        )
        for name, e in header.items()
    }


def test_the_fake_torch_refuses_to_import(no_torch_env: dict[str, str]) -> None:
    """Control: in that environment, importing torch fails."""
    run = subprocess.run(
        [sys.executable, "-c", "import torch"], env=no_torch_env, capture_output=True, text=True
    )
    assert run.returncode != 0 and "must not import torch" in run.stderr


def test_views_convert_without_torch_to_safetensors_bytes(
    tmp_path: Path, no_torch_env: dict[str, str]
) -> None:
    tensors = views()
    assert not tensors["transposed"].is_contiguous()  # gathered without torch too
    src, out, reference = tmp_path / "views.pt", tmp_path / "out.safetensors", tmp_path / "ref"
    torch.save(tensors, src)
    command = [sys.executable, "-m", "ckpt_tools", "convert", str(src), str(out)]
    run = subprocess.run(
        [*command, "--verify", "full"],
        env=no_torch_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    got = tensor_bytes(out)
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        # One file per tensor: save_file refuses several tensors that share memory.
        save_file({name: t.contiguous()}, str(reference))
        assert got[name] == tensor_bytes(reference)[name], name
