"""An NJT made by ``torch.nested.nested_tensor(..., layout=torch.jagged)`` loads as
torch.load(weights_only=True) loads it once ``torch._dynamo`` is imported (as torch's refusal
asks): its cached sequence lengths keep their ``_dynamo_dynamic_range`` of real ``_DimRange``
objects, and torch._dynamo is imported only for a file that holds them."""

from __future__ import annotations

from pathlib import Path

import torch

from ckpt_tools import load_state_dict
from tests.helpers.child_oracle import json_per_path

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
    (want,) = json_per_path(_ORACLE, path, preload=("torch", "torch._dynamo"))

    got = load_state_dict(path, map_location="cpu")["nj"]
    assert _described(got) == want
    from torch._dynamo.decorators import _DimRange

    for cached in got._metadata_cache.values():
        assert {type(r) for r in cached._dynamo_dynamic_range} == {_DimRange}


# Whether torch._dynamo is imported after loading each file in turn.
_LAZY = """
import json, sys
from ckpt_tools import load_state_dict
for path in sys.argv[1:]:
    load_state_dict(path, map_location="cpu")
    print(json.dumps({"dynamo": "torch._dynamo" in sys.modules}))
"""


def test_torch_dynamo_is_imported_only_for_a_file_holding_ranges(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2)}, plain)
    njt = _saved(tmp_path / "njt.pt")
    assert json_per_path(_LAZY, plain, njt) == [{"dynamo": False}, {"dynamo": True}]
