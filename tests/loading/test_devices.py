"""devices: listing, picking the freest GPUs, CUDA_VISIBLE_DEVICES, ``ckpt devices``."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ckpt_tools import list_devices, pick_devices
from ckpt_tools.cli.main import main
from ckpt_tools.errors import UsageError
from ckpt_tools.loading.devices import DeviceInfo, visible_devices_for

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_list_devices_ends_with_the_cpu() -> None:
    devices = list_devices()
    cpu = devices[-1]
    assert cpu.device == "cpu" and cpu.type == "cpu" and cpu.index is None
    assert cpu.total_memory and cpu.total_memory > 0
    assert cpu.free_memory is None or 0 < cpu.free_memory <= cpu.total_memory
    gpus = [d for d in devices if d.type == "cuda"]
    assert len(gpus) == torch.cuda.device_count()
    assert [d.free_memory for d in gpus] == sorted((d.free_memory for d in gpus), reverse=True)


@cpu_only
def test_without_gpus_pick_gives_the_cpu() -> None:
    assert pick_devices() == [torch.device("cpu")]
    assert pick_devices(count=3) == [torch.device("cpu")]
    assert visible_devices_for(2) == ""


def test_asking_for_no_device_is_an_error() -> None:
    with pytest.raises(UsageError, match="at least 1"):
        pick_devices(count=0)
    with pytest.raises(UsageError, match="at least 1"):
        visible_devices_for(-1)


def test_device_info_json() -> None:
    info = DeviceInfo("cuda:1", "Test GPU", 80, 60, "3", (9, 0))
    assert (info.type, info.index) == ("cuda", 1)
    assert info.to_json()["capability"] == [9, 0]


def test_cli_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "cpu" in out and "free" in out
    assert main(["devices", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[-1]["device"] == "cpu" and data[-1]["total_memory"] > 0


@gpu
@needs_cuda
def test_pick_orders_gpus_by_free_memory() -> None:
    count = torch.cuda.device_count()
    picked = pick_devices(count=count)
    assert sorted(d.index for d in picked) == list(range(count))
    free = [torch.cuda.mem_get_info(d.index)[0] for d in picked]
    # Free memory moves a little between calls; the order must hold within 256 MiB.
    assert all(a >= b - (256 << 20) for a, b in itertools.pairwise(free))
    with pytest.raises(UsageError, match=f"{count} are visible"):
        pick_devices(count=count + 1)


@gpu
@needs_cuda
def test_visible_devices_translate_through_the_current_mask() -> None:
    ids = visible_devices_for(torch.cuda.device_count()).split(",")
    assert len(ids) == torch.cuda.device_count()
    assert ids[0] == list_devices()[0].visible_id
