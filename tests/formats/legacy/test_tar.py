"""torch's tar format (torch < 0.4): storage views, device tags, broken references.

Files are written by hand with ``write_torch_tar`` (fixtures/make_fixtures.py) and loaded
with ``torch.load(weights_only=False)`` as the reference: safe, since the tests wrote them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools import CorruptCheckpointError
from ckpt_tools.descriptors import StorageRef
from ckpt_tools.formats import open_checkpoint
from tests.helpers import read_span, tensor_from_span, tools, value_bytes


def records_with_view(location: str = "cpu") -> Any:
    """Storage 1 (12 floats); storage 2 views its elements 4..9; tensors on both."""
    t = tools()
    data = torch.arange(12, dtype=torch.float32).numpy().tobytes()
    return t.TarRecords(
        main={"whole": t.TarKey(10), "on_view": t.TarKey(11), "view_storage": t.TarKey(2)},
        storages=[t.TarStorage(1, torch.float32, data, location)],
        views=[(2, 1, 4, 6)],
        tensors=[
            t.TarTensor(10, 1, torch.float32, (3, 4), (4, 1), 0),
            t.TarTensor(11, 2, torch.float32, (2, 2), (1, 2), 1),
        ],
    )


def element_offset(tensor: torch.Tensor, root: torch.Tensor) -> int:
    """Where ``tensor`` starts in ``root``'s storage, in elements, by torch's pointers."""
    delta = tensor.untyped_storage().data_ptr() - root.untyped_storage().data_ptr()
    return delta // tensor.element_size() + tensor.storage_offset()


def test_tensor_on_a_storage_view(make_tar: Callable[..., Path]) -> None:
    path = make_tar(records_with_view())
    loaded = torch.load(path, weights_only=False)
    whole, on_view = loaded["whole"], loaded["on_view"]

    info = ckpt_tools.inspect(path)
    assert info.format == "torch-tar"
    got = {t.name: t for t in info.tensors}
    assert got["on_view"].storage == got["whole"].storage, "a view shares its root's memory"
    assert got["on_view"].offset == element_offset(on_view, whole)
    assert got["on_view"].stride == on_view.stride()
    assert got["on_view"].shape == tuple(on_view.shape)

    ckpt = open_checkpoint(path)
    for name in ("whole", "on_view"):
        assert value_bytes(tensor_from_span(ckpt, ckpt.root[name])).equal(
            value_bytes(loaded[name])
        ), name


def test_storage_view_saved_as_a_value(make_tar: Callable[..., Path]) -> None:
    path = make_tar(records_with_view())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        untyped = torch.load(path, weights_only=False)["view_storage"].untyped()
    ckpt = open_checkpoint(path)
    ref = ckpt.root["view_storage"]
    assert isinstance(ref, StorageRef)
    assert (ref.dtype, ref.nbytes) == ("float32", untyped.nbytes())
    expected = torch.empty(0, dtype=torch.uint8).set_(untyped).numpy().tobytes()
    assert read_span(ckpt, ref) == expected


@pytest.mark.parametrize("location", ["cuda:0", "cuda:1"])
def test_device_tags(make_tar: Callable[..., Path], location: str) -> None:
    path = make_tar(records_with_view(location))
    seen: list[str] = []

    def record(storage: Any, tag: str) -> Any:
        seen.append(tag)
        return storage

    torch.load(path, weights_only=False, map_location=record)
    info = ckpt_tools.inspect(path)
    assert set(seen) == {location}
    assert info.devices == {location: 2}


def test_reference_to_a_missing_tensor(make_tar: Callable[..., Path]) -> None:
    records = records_with_view()
    records.main["ghost"] = tools().TarKey(99)
    path = make_tar(records)
    with pytest.raises(KeyError):
        torch.load(path, weights_only=False)
    with pytest.raises(CorruptCheckpointError, match=r"refers to '99'.*neither a tensor"):
        ckpt_tools.inspect(path)


def test_view_outside_its_root(make_tar: Callable[..., Path]) -> None:
    records = records_with_view()
    records.views[0] = (2, 1, 10, 6)  # elements 10..15 of a 12-element storage
    path = make_tar(records)
    with pytest.raises(CorruptCheckpointError, match=r"storage view 2 .* does not fit"):
        ckpt_tools.inspect(path)


def test_tensor_past_its_storage(make_tar: Callable[..., Path]) -> None:
    records = records_with_view()
    t = records.tensors[0]
    records.tensors[0] = type(t)(t.key, t.storage_key, t.dtype, (4, 4), (4, 1), 0)
    path = make_tar(records)
    with pytest.raises(CorruptCheckpointError, match=r"reaches element 15.*holds 12"):
        ckpt_tools.inspect(path)


def test_storage_longer_than_its_member(make_tar: Callable[..., Path]) -> None:
    records = records_with_view()
    storage = records.storages[0]
    records.storages[0] = type(storage)(storage.key, storage.dtype, storage.data, numel=1000)
    path = make_tar(records)
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=False)
    with pytest.raises(CorruptCheckpointError, match=r"truncated: storage 1 needs 4000 bytes"):
        ckpt_tools.inspect(path)
