"""Jagged nested tensors (NJTs) are read as torch.load(weights_only=True) reads them, or
refused naming the globals torch names.

The oracle runs in a fresh process: ``import torch`` allowlists the NJT's own globals, and
only an imported ``torch._dynamo`` allowlists the ``_DimRange`` that ``nested_tensor`` leaves
in an NJT's metadata; this test process may have imported it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckpt_tools as ct
from ckpt_tools.descriptors import RebuiltTensor
from ckpt_tools.formats import open_checkpoint
from tests.helpers.child_oracle import json_per_path

_ORACLE = """
import json, sys, torch
for path in sys.argv[1:]:
    try:
        torch.load(path, weights_only=True)
        error = ""
    except Exception as e:
        error = type(e).__name__
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    print(json.dumps({"error": error, "unsafe": sorted(names)}))
"""


def torch_outcomes(*paths: Path) -> list[dict[str, Any]]:
    """What a fresh ``import torch`` process makes of each file: the refusal's type ('' when
    torch.load(weights_only=True) loads it) and the globals torch names as unsafe."""
    return json_per_path(_ORACLE, *paths)


def _values() -> torch.Tensor:
    return torch.arange(16.0).reshape(8, 2)


def test_a_jagged_tensor_torch_loads_is_read_as_one(tmp_path: Path) -> None:
    path = tmp_path / "njt.pt"
    offsets = torch.tensor([0, 3, 8])
    plain = torch.nested.nested_tensor_from_jagged(_values(), offsets)
    lengths = torch.nested.nested_tensor_from_jagged(_values(), offsets, torch.tensor([2, 4]))
    torch.save({"w": torch.ones(3), "n": plain, "l": lengths}, path)
    assert torch_outcomes(path) == [{"error": "", "unsafe": []}]

    ckpt = open_checkpoint(path)
    assert ckpt.unsafe_globals == ()
    n, ln = ckpt.root["n"], ckpt.root["l"]
    assert isinstance(n, RebuiltTensor) and isinstance(ln, RebuiltTensor)
    assert (n.layout, n.shape, n.dtype, n.device) == ("jagged", (2, -1, 2), "float32", "cpu")
    assert [p.dtype for p in n.parts] == ["float32", "int64"]
    assert [p.dtype for p in ln.parts] == ["float32", "int64", "int64"]
    listed = {t.name: (t.layout, list(t.shape)) for t in ct.inspect(str(path)).tensors}
    assert listed == {
        "w": ("strided", [3]),
        "n": ("jagged", [2, -1, 2]),
        "l": ("jagged", [2, -1, 2]),
    }


def test_a_jagged_tensor_torch_refuses_only_without_dynamo_is_read(tmp_path: Path) -> None:
    # torch refuses it in a fresh process until torch._dynamo is imported (its message asks
    # for that import); the reader allows _DimRange as that import does
    # (tests/formats/pickle/test_jagged_dim_range.py compares with torch after the import).
    path = tmp_path / "njt.pt"
    njt = torch.nested.nested_tensor([torch.ones(3, 2), torch.ones(5, 2)], layout=torch.jagged)
    torch.save({"w": torch.ones(3), "n": njt}, path)
    (want,) = torch_outcomes(path)
    assert want == {"error": "UnpicklingError", "unsafe": ["torch._dynamo.decorators._DimRange"]}

    assert ct.inspect(str(path)).unsafe_globals == ()
    assert ct.load_state_dict(path)["n"].is_nested
