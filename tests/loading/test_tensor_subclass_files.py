"""A state dict of tensor subclasses saved by ``torch.save`` (an FSDP2 model's DTensors) is
chosen as the state dict: refused naming its classes, and read by ``torch.load`` with
``trust=True``, as torch reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import UnsafeContentError
from tests.helpers.child_oracle import json_per_path

# Saves an FSDP2 model's state dict (DTensors over a one-rank gloo mesh) to argv[1].
_SAVE_FSDP2 = """
import json, os, sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
torch.save(model.state_dict(), sys.argv[1])
dist.destroy_process_group()
print(json.dumps({"saved": sorted(model.state_dict())}))
"""


@pytest.fixture(scope="module")
def dtensor_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fsdp2") / "fsdp2.pt"
    (saved,) = json_per_path(_SAVE_FSDP2, path)
    assert saved == {"saved": ["0.bias", "0.weight"]}
    return path


def test_without_trust_the_subclass_is_refused_by_name(dtensor_file: Path) -> None:
    with pytest.raises(UnsafeContentError, match=r"torch\.distributed\.tensor\.DTensor"):
        ct.load_state_dict(dtensor_file)


def test_with_trust_the_state_dict_is_what_torch_load_returns(dtensor_file: Path) -> None:
    from torch.distributed.tensor import DTensor

    want = torch.load(dtensor_file, weights_only=False)
    got = ct.load_state_dict(dtensor_file, trust=True)
    assert list(got) == list(want) == ["0.weight", "0.bias"]
    for key, value in want.items():
        assert isinstance(got[key], DTensor)
        assert torch.equal(got[key].to_local(), value.to_local()), key
