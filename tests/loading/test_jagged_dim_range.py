"""An NJT made by ``torch.nested.nested_tensor(..., layout=torch.jagged)`` loads as
torch.load(weights_only=True) loads it once ``torch._dynamo`` is imported (as torch's refusal
asks): its cached sequence lengths keep their ``_dynamo_dynamic_range`` of real ``_DimRange``
objects, and torch._dynamo is imported only for a file that holds them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ckpt_tools import load_state_dict

_ORACLE = """
import json, sys, torch, torch._dynamo
nj = torch.load(sys.argv[1], weights_only=True)["nj"]
print(json.dumps({
    "values": nj.values().tolist(),
    "offsets": nj.offsets().tolist(),
    "attributes": sorted(vars(nj)),
    "cache": {
        k: [sorted(vars(v)), [[r.dim, r.min, r.max] for r in v._dynamo_dynamic_range]]
        for k, v in nj._metadata_cache.items()
    },
}))
"""


def _described(nj: torch.Tensor) -> dict:
    return {
        "values": nj.values().tolist(),
        "offsets": nj.offsets().tolist(),
        "attributes": sorted(vars(nj)),
        "cache": {
            k: [sorted(vars(v)), [[r.dim, r.min, r.max] for r in v._dynamo_dynamic_range]]
            for k, v in nj._metadata_cache.items()
        },
    }


def _saved(path: Path) -> Path:
    njt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    torch.save({"w": torch.ones(2), "nj": njt}, path)
    return path


def test_an_njt_loads_with_its_dynamic_ranges_as_torch_loads_it(tmp_path: Path) -> None:
    path = _saved(tmp_path / "njt.pt")
    done = subprocess.run(
        [sys.executable, "-c", _ORACLE, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    want = json.loads(done.stdout.strip().splitlines()[-1])

    got = load_state_dict(path, map_location="cpu")["nj"]
    assert _described(got) == want
    from torch._dynamo.decorators import _DimRange

    for cached in got._metadata_cache.values():
        assert {type(r) for r in cached._dynamo_dynamic_range} == {_DimRange}


_LAZY = """
import sys
from ckpt_tools import load_state_dict
load_state_dict(sys.argv[1], map_location="cpu")
before = "torch._dynamo" in sys.modules
load_state_dict(sys.argv[2], map_location="cpu")
print(before, "torch._dynamo" in sys.modules)
"""


def test_torch_dynamo_is_imported_only_for_a_file_holding_ranges(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)
    njt = _saved(tmp_path / "njt.pt")
    done = subprocess.run(
        [sys.executable, "-c", _LAZY, str(plain), str(njt)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.split() == ["False", "True"]
