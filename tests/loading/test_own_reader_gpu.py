"""load_state_dict and load_into onto a GPU, read or (``mmap=True``) straight from the mapped
file (marked ``gpu``; skipped where no CUDA device is visible)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckpt_tools import load_into, load_state_dict, load_with_info
from ckpt_tools.ops.rewrite.conversion import retag
from tests.loading.test_own_reader import _zoo, assert_like_torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("form", ["cuda", "cuda:0", torch.device("cuda", 0), {"cpu": "cuda:0"}])
def test_map_location_cuda_matches_torch_load(tmp_path: Path, form: Any) -> None:
    zoo = _zoo()
    zoo.pop("meta")
    path = str(tmp_path / "zoo.pt")
    torch.save(zoo, path)
    ours, info = load_with_info(path, map_location=form)
    theirs = torch.load(path, map_location=form, weights_only=True)
    assert_like_torch(ours, theirs)  # devices, sharing (on the GPU) and bytes included
    assert {p.target.partition(":")[0] for p in info.placements} == {"cuda"}
    assert all(p.saved == "cpu" for p in info.moved)


def test_auto_puts_gpu_tagged_storages_on_a_gpu_and_callables_get_cpu_storages(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    weights = nn.Linear(8, 4).state_dict()
    plain = str(tmp_path / "plain.pt")
    torch.save(weights, plain)
    tagged = str(tmp_path / "cuda0.pt")
    retag(plain, tagged, mapping={"cpu": "cuda:0"})
    sd = load_state_dict(tagged)
    assert {str(t.device) for t in sd.values()} == {"cuda:0"}
    seen: list[tuple[str, str]] = []

    def to_gpu(storage: Any, tag: str) -> Any:
        seen.append((str(storage.device), tag))
        return storage.cuda(0)

    sd, info = load_with_info(plain, map_location=to_gpu)
    assert seen == [("cpu", "cpu")] * len(weights)  # as torch.load calls it
    assert [(p.saved, p.target) for p in info.placements] == [("cpu", "cuda:0")]
    for key, value in weights.items():
        assert torch.equal(sd[key].cpu(), value)


def test_a_file_saved_on_cuda1_loads_on_cuda0_as_torch_maps_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).cuda()
    real = str(tmp_path / "real.pt")
    torch.save(model.state_dict(), real)  # a real GPU save: every storage tagged cuda:0
    moved = str(tmp_path / "cuda1.pt")
    retag(real, moved, mapping={"cuda:0": "cuda:1"})  # as if saved on a second GPU
    theirs = torch.load(moved, map_location={"cuda:1": "cuda:0"}, weights_only=True)
    for form in ({"cuda:1": "cuda:0"}, "cuda:0", "auto"):
        ours, info = load_with_info(moved, map_location=form)
        assert_like_torch(ours, theirs)
        assert {(p.saved, p.target) for p in info.placements} == {("cuda:1", "cuda:0")}, form
    if torch.cuda.device_count() == 1:
        with pytest.raises(RuntimeError):
            torch.load(moved, weights_only=True)
    fresh = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).cuda()
    report = load_into(fresh, moved)
    assert report.ok
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_meta_model_loads_onto_the_gpu(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval()
    path = str(tmp_path / "m.pt")
    torch.save(model.state_dict(), path)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)).eval()
    report = load_into(meta, path, map_location="cuda")
    assert report.assigned and report.ok
    assert {p.device.type for p in meta.parameters()} == {"cuda"}
    x = torch.randn(2, 16)
    with torch.no_grad():
        assert torch.allclose(meta(x.cuda()).cpu(), model(x))


def test_a_meta_model_takes_a_gpu_checkpoint_where_it_was_saved_by_default(
    tmp_path: Path,
) -> None:
    # Assigned tensors are the model's own: "auto" keeps the saved device, as load_state_dict.
    model = nn.Linear(8, 8).cuda()
    path = str(tmp_path / "gpu.pt")
    torch.save(model.state_dict(), path)
    with torch.device("meta"):
        meta = nn.Linear(8, 8)
    report = load_into(meta, path)
    assert report.assigned and report.ok
    assert {p.device for p in meta.parameters()} == {model.weight.device}
    assert torch.equal(meta.weight, model.weight)


def test_loading_to_the_gpu_makes_no_anonymous_host_copy(tmp_path: Path) -> None:
    path = str(tmp_path / "big.pt")
    torch.save({f"w{i}": torch.randn(8 << 20) for i in range(8)}, path)  # 256 MiB
    size = Path(path).stat().st_size
    torch.empty(1, device="cuda")  # the CUDA context's own host memory, before measuring
    before = _rss_anon()
    sd = load_state_dict(path, map_location="cuda", mmap=True)
    torch.cuda.synchronize()
    grown = _rss_anon() - before
    assert len(sd) == 8 and sd["w0"].is_cuda
    # The bytes go from the mapped page cache to the device; a host copy would be ~size.
    assert grown < size // 2, (grown, size)
