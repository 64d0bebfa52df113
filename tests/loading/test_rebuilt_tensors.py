"""Sparse, meta and nested tensors load as torch.load(weights_only=True) loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools import load_state_dict
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests.helpers.builders import rebuilt_tensors
from tests.helpers.committed import tools


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.layout != want.layout or got.device != want.device or got.dtype != want.dtype:
        return False
    if want.is_nested:
        return all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind(), strict=True))
    if want.is_meta:
        return got.shape == want.shape and got.stride() == want.stride()
    return torch.equal(got.to_dense(), want.to_dense())


def test_sparse_meta_and_nested_tensors_load_as_torch_loads_them(tmp_path: Path) -> None:
    path = tmp_path / "rebuilt.pt"
    torch.save(rebuilt_tensors(), path)
    want = torch.load(path, weights_only=True)
    got = load_state_dict(path)  # found as the state dict: they count as tensors
    assert list(got) == list(want)
    for name in want:
        assert _same(got[name], want[name]), name


def test_a_nested_tensor_past_its_buffer_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "nested.pt"
    torch.save({"nt": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])}, src)
    # The second component starts at element 7 instead of 6: its last one lies past the end.
    offsets = open_checkpoint(src).root["nt"].args[3].storage.key
    moved = torch.tensor([0, 7]).numpy().tobytes()
    bad = tmp_path / "bad.pt"
    tools().rewrite_zip(src, bad, replace={f"data/{offsets}": moved})
    with pytest.raises(CorruptCheckpointError, match="past the end"):
        load_state_dict(bad)


class _OnDevice:
    """Pickles as torch.save pickles a tensor of a backend without storages (xla, mtia)."""

    def __init__(self, *args: object) -> None:
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return torch._utils._rebuild_device_tensor_from_cpu_tensor, self.args


@pytest.mark.parametrize(
    ("tag", "map_location"),
    [("cpu", None), ("cpu", "meta"), ("xla:0", "cpu"), ("xla:0", {"xla:0": "cpu"})],
)
def test_a_device_tensor_loads_where_map_location_sends_its_tag(
    tmp_path: Path, tag: str, map_location: object
) -> None:
    path = tmp_path / "device.pt"
    data = torch.arange(6.0).reshape(2, 3)[:, 1:]
    torch.save({"v": _OnDevice(data, torch.float16, tag, True), "w": torch.ones(2)}, path)
    want = torch.load(path, weights_only=True, map_location=map_location)
    # torch's rebuild maps the tag through the map_location the last torch.load left set:
    # loading another way in between must change nothing here.
    torch.load(path, weights_only=True, map_location="meta")
    got = load_state_dict(path, map_location=map_location)
    assert _same(got["v"], want["v"]) and got["v"].requires_grad
    assert _same(got["w"], want["w"])


def test_a_device_tensor_whose_copy_is_no_tensor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "device.pt"
    torch.save({"v": _OnDevice(None, torch.float32, "cpu", False), "w": torch.ones(1)}, path)
    with pytest.raises(AttributeError):
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=r"'v'.*not a tensor"):
        load_state_dict(path)
