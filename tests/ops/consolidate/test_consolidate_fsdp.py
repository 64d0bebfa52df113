"""``consolidate`` on DCP checkpoints saved by FSDP2 from 2 and 4 gloo CPU processes.

Each checkpoint is saved once per module (spawning 4 processes on a small machine takes
most of a minute): model and Adam state, uneven dim-0 splits where a rank holds nothing,
DTensors sharded on dim 1 and on a 2-D mesh. Oracle: ``dcp_to_torch_save`` + ``torch.load``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools import consolidate
from ckpt_tools.formats.dcp.metadata import read_metadata
from tests.helpers.dcp_save import reference, save_fsdp, tiny_model
from tests.ops.consolidate.test_consolidate import assert_same

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not built in"
    ),
    pytest.mark.slow,  # ranks spawned to train a step and save
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = save_fsdp(tmp_path_factory.mktemp("fsdp2") / "ckpt", 2, "float32", layouts=True)
    return folder, reference(folder, folder.parent / "theirs.pt")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = save_fsdp(tmp_path_factory.mktemp("fsdp4") / "ckpt", 4, "bfloat16", layouts=True)
    return folder, reference(folder, folder.parent / "theirs.pt")


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_all_equals_dcp_to_torch_save(
    ranks: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    folder, want = request.getfixturevalue(ranks)
    result = consolidate(folder, tmp_path / "all.pt", include_all=True)
    assert_same(want, torch.load(tmp_path / "all.pt", weights_only=True))
    # Model, optimizer (exp_avg, exp_avg_sq, step per parameter) and the extra layouts.
    assert set(want) == {"model", "optim", "extra", "step"}
    assert result.bytes_copied < result.bytes_written  # dim-1 / 2-D chunks were assembled


def test_layouts_are_what_the_test_claims(four_ranks: tuple[Path, Any]) -> None:
    folder, _ = four_ranks
    items = read_metadata(str(folder)).items
    first = items["model.0.weight"]  # 3 rows over 4 ranks: one rank holds nothing
    assert len(first.chunks) == 4
    assert sum(1 for c in first.chunks if math.prod(c.sizes)) == 3
    assert len({c.file for c in first.chunks}) == 4
    grid = items["extra.grid"]  # a 2x2 mesh: chunks split both dims
    assert {c.offsets for c in grid.chunks} == {(0, 0), (0, 5), (3, 0), (3, 5)}
    assert first.dtype == "bfloat16" and items["model.counts"].dtype == "int64"
    assert items["model.mask"].dtype == "bool"


def test_model_loads_into_a_bare_model(two_ranks: tuple[Path, Any], tmp_path: Path) -> None:
    folder, want = two_ranks
    consolidate(folder, tmp_path / "model.pt")
    model = tiny_model(None)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    loaded = model.state_dict()  # (in the module's order, not the saved one)
    assert sorted(loaded) == sorted(want["model"])
    for name, tensor in want["model"].items():
        assert_same(tensor, loaded[name], name)


@pytest.mark.parametrize("ranks", ["two_ranks", "four_ranks"])
def test_hf_shards(ranks: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    folder, want = request.getfixturevalue(ranks)
    out = tmp_path / "hf"
    consolidate(folder, out, max_shard_size="100B", jobs=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / shard)
        assert all(index["weight_map"][k] == shard for k in tensors)
        got.update(tensors)
    assert sorted(got) == sorted(want["model"])
    for name, tensor in want["model"].items():
        assert_same(tensor, got[name], name)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want["model"].values())


def test_safetensors_of_everything_holds_int_and_bool(
    four_ranks: tuple[Path, Any], tmp_path: Path
) -> None:
    # torch's own safetensors consolidator raises on int and bool dtypes (torch.finfo).
    folder, want = four_ranks
    result = consolidate(folder, tmp_path / "all.safetensors", include_all=True, drop_extras=True)
    got = load_file(tmp_path / "all.safetensors")
    assert "optim.param_groups.0.lr" in result.dropped
    assert_same(want["model"]["counts"], got["model.counts"])
    assert_same(want["model"]["mask"], got["model.mask"])
    assert_same(want["extra"]["grid_t"], got["extra.grid_t"])
    assert_same(want["optim"]["state"]["0.weight"]["exp_avg"], got["optim.state.0.weight.exp_avg"])
