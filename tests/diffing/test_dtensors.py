"""diff() of DTensors: compared through the local tensor where that is the whole tensor,
refused (not hung) where seeing it whole takes a collective; a ``torch.save``d FSDP2 state dict
is a file of tensors diff does not read, never "0 tensors"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_tools.diffing.engine import diff
from tests.helpers import run_ckpt
from tests.helpers.child_oracle import json_per_path

ROOT = Path(__file__).resolve().parents[2]

# Each runs in a fresh process (a process group is process-wide) and prints one JSON line.
_FSDP2_ONE_RANK = f"""
import json, sys, tempfile, torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT)!r})
import ckpt_tools as ct
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
sharded = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
sharded.load_state_dict(plain.state_dict())
fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
out = {{}}
for name, side in (("module", sharded), ("state_dict", sharded.state_dict())):
    report = ct.diff(side, plain)
    out[name] = [report.identical, sorted({{t.status for t in report.tensors}})]
with torch.no_grad():
    plain[0].bias.add_(1)
out["differ"] = [t.name for t in ct.diff(sharded, plain).value_mismatches]
dist.destroy_process_group()
print(json.dumps(out))
"""

_TWO_RANKS = f"""
import json, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT)!r})
import ckpt_tools as ct
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
net = torch.nn.Linear(4, 2)
def spread(placement):
    sd = net.state_dict()
    return {{k: distribute_tensor(v.detach(), mesh, [placement]) for k, v in sd.items()}}
out = {{}}
try:
    ct.diff(spread(Shard(0)), net)
except ct.CheckpointError as e:
    out["refused"] = [type(e).__name__, e.exit_code, str(e)]
report = ct.diff(spread(Shard(0)), net, values=False)
out["values_false"] = [[t.name, t.status, list(t.shape_a)] for t in report.tensors]
out["replicated"] = ct.diff(spread(Replicate()), net).identical
dist.destroy_process_group()
print(json.dumps(out))
"""

_SAVE_FSDP2 = """
import json, sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4))
torch.save(model.state_dict(), sys.argv[1].replace("fsdp2.pt", "plain.pt"))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
torch.save(model.state_dict(), sys.argv[1])
dist.destroy_process_group()
print(json.dumps({"saved": sorted(model.state_dict())}))
"""


def test_an_fsdp2_model_on_one_rank_is_compared_through_its_local_tensors(
    tmp_path: Path,
) -> None:
    (out,) = json_per_path(_FSDP2_ONE_RANK, tmp_path)
    assert out["module"] == out["state_dict"] == [True, ["equal"]]
    assert out["differ"] == ["0.bias"]


def test_a_dtensor_over_two_ranks_is_refused_for_values_not_gathered(tmp_path: Path) -> None:
    (out,) = json_per_path(_TWO_RANKS, tmp_path)
    name, exit_code, message = out["refused"]
    assert (name, exit_code) == ("UsageError", 2)
    assert "'weight' is a DTensor spread over 2 ranks (Shard(dim=0))" in message
    assert "StateDictOptions(full_state_dict=True)" in message and "values=False" in message
    assert out["values_false"] == [["weight", "unchecked", [2, 4]], ["bias", "unchecked", [2]]]
    assert out["replicated"] is True


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("fsdp2")
    (out,) = json_per_path(_SAVE_FSDP2, folder / "fsdp2.pt")
    assert out == {"saved": ["0.bias", "0.weight"]}
    return folder / "fsdp2.pt", folder / "plain.pt"


def test_a_saved_fsdp2_state_dict_is_tensors_diff_does_not_read(
    saved: tuple[Path, Path],
) -> None:
    fsdp2, plain = saved
    for values in (True, False):
        report = diff(fsdp2, plain, values=values)
        assert report.a.unsupported == ("0.weight", "0.bias") and report.a.tensors == 0
        assert report.a.skipped == () and report.found() == {"kind"} and not report.identical
        weight = report.tensor("0.weight")
        assert (weight.status, weight.kind_a, weight.kind_b) == (
            "kind",
            "torch.distributed.tensor.DTensor",
            "tensor",
        )
        assert (weight.dtype_a, weight.shape_a) == ("float32", (4, 3))
        assert "a tensor subclass diff does not read" in weight.note
        same = diff(fsdp2, fsdp2, values=values)
        assert same.found() == {"kind"} and not same.identical and len(same.tensors) == 2
        against_model = diff(fsdp2, nn.Sequential(nn.Linear(3, 4)), values=values)
        assert against_model.found() == {"kind"} and against_model.missing == ()


def test_the_command_never_says_zero_tensors_and_fails_on_them(
    saved: tuple[Path, Path],
) -> None:
    fsdp2, plain = saved
    for b in (plain, fsdp2):
        code, out, _ = run_ckpt("diff", fsdp2, b, "--fail-on", "any", code=None)
        assert code == 1 and "failing on: kind" in out
        assert "0 tensors" not in out and "2 tensors of a subclass diff does not read" in out
        assert "_rebuild_from_type_v2" not in out
    code, out, _ = run_ckpt("diff", fsdp2, plain, "--json", "--no-values", code=None)
    report = json.loads(out)
    assert code == 0 and report["a"]["unsupported"] == ["0.weight", "0.bias"]
    assert [t["status"] for t in report["tensors"]] == ["kind", "kind"]
    assert torch.load(plain)["0.weight"].shape == (4, 3)
