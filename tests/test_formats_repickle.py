"""The re-pickler: a tree read by ``load_pickle`` written back is what torch wrote.

Also: device tags changed on the way (``cpu`` -> ``cuda:1``), which gives a checkpoint that
claims a GPU on a machine without one.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from tests.helpers import (
    assert_bitwise_equal,
    by_name,
    fixture_path,
    fixtures_where,
    read_data_pkl,
    repickle_zip,
)

ZIPS = fixtures_where(format="torch-zip", oracle="torch")
SCRIPTS = fixtures_where(format="torchscript")


@pytest.mark.parametrize("entry", **by_name(ZIPS))
def test_repickled_zip_loads_as_the_original(entry: dict[str, Any], tmp_path: Path) -> None:
    src, dst = fixture_path(entry["name"]), tmp_path / entry["name"]
    payload = repickle_zip(src, dst, protocol=2)
    assert payload == read_data_pkl(src), "torch's data.pkl is re-emitted byte for byte"
    assert_bitwise_equal(torch.load(src, weights_only=True), torch.load(dst, weights_only=True))


@pytest.mark.parametrize("entry", **by_name(SCRIPTS))
def test_repickled_torchscript_loads_with_jit(entry: dict[str, Any], tmp_path: Path) -> None:
    src, dst = fixture_path(entry["name"]), tmp_path / entry["name"]
    repickle_zip(src, dst, protocol=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_bitwise_equal(
            dict(torch.jit.load(src).state_dict()), dict(torch.jit.load(dst).state_dict())
        )


@pytest.mark.parametrize("name", ["trainer_adam.pt", "tied_views.pt", "dtypes.pt"])
def test_retagged_devices(name: str, tmp_path: Path) -> None:
    """Storages saved as cuda:1 (crafted: no GPU here) are reported as cuda:1 and still load."""
    src, dst = fixture_path(name), tmp_path / name
    payload = repickle_zip(src, dst, protocol=2, device_map={"cpu": "cuda:1"})
    assert b"cuda:1" in payload and b"cpu" not in payload

    info, before = ckpt_tools.inspect(dst), ckpt_tools.inspect(src)
    assert info.tensors and info.devices == {"cuda:1": len(info.tensors)}
    assert list(info.tensors) == [replace(t, device="cuda:1") for t in before.tensors]

    seen: list[str] = []

    def record(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage

    retagged = torch.load(dst, map_location=record, weights_only=True)
    assert set(seen) == {"cuda:1"}, "torch reads the new tag"
    assert_bitwise_equal(torch.load(src, weights_only=True), retagged)
    assert_bitwise_equal(retagged, torch.load(dst, map_location="cpu", weights_only=True))
