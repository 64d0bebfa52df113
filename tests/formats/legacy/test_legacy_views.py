"""Legacy storage views (torch < 1.0): located inside their root, refused where torch refuses.

No torch we can install writes storage views any more, so the files are written by hand in
torch's legacy layout, with our re-pickler for the object pickle. ``torch.load`` (safe here:
the tests wrote the files) is the oracle.
"""

from __future__ import annotations

import collections
import pickle
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.descriptors import GlobalRef, StorageRef, TensorRef
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle.repickle import dumps
from ckpt_tools.formats.pickle.standins import StorageTypeRef
from tests.helpers import tensor_from_span, tools, value_bytes

FLOAT = StorageTypeRef("torch", "FloatStorage")
REBUILD = GlobalRef("torch._utils", "_rebuild_tensor_v2")
SYS_INFO = {"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}}


def tensor(storage: StorageRef, offset: int, shape: tuple[int, ...], stride: tuple[int, ...]):
    args = (storage, offset, shape, stride, False, collections.OrderedDict())
    return TensorRef(storage, offset, shape, stride, "float32", func=REBUILD, args=args)


def storage_id(storage: StorageRef) -> tuple[Any, ...]:
    """torch's legacy persistent id: the root's key and count, then the view (or None)."""
    return (
        "storage",
        storage.storage_type,
        storage.key,
        storage.device,
        storage.numel,
        storage.view,
    )


def legacy_file(path: Path, view: tuple[str, int, int], geometry: tuple[Any, ...]) -> Path:
    """12 floats in storage ``0``; tensor ``whole`` on it, ``on_view`` on ``view`` of it."""
    root = StorageRef("0", "float32", 12, "cpu", FLOAT)
    on_view = StorageRef("0", "float32", 12, "cpu", FLOAT, view=view)
    tree = {"whole": tensor(root, 0, (12,), (1,)), "on_view": tensor(on_view, *geometry)}
    head = [0x1950A86A20F9469CFC6C, 1001, SYS_INFO]
    data = b"".join(pickle.dumps(value, protocol=2) for value in head)
    data += dumps(tree, 2, storage_id) + pickle.dumps(["0"], protocol=2)
    path.write_bytes(data + struct.pack("<q", 12) + torch.arange(12.0).numpy().tobytes())
    return path


def torch_load(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        return torch.load(path, weights_only=False)


def test_a_tensor_on_a_view_reads_what_torch_loads(tmp_path: Path) -> None:
    path = legacy_file(tmp_path / "view.pt", ("2", 4, 6), (1, (2, 2), (1, 2)))
    loaded = torch_load(path)
    ckpt = open_checkpoint(path)
    assert ckpt.format == "torch-legacy"
    for name in ("whole", "on_view"):
        assert value_bytes(tensor_from_span(ckpt, ckpt.root[name])).equal(
            value_bytes(loaded[name])
        ), name
    assert ckpt.root["on_view"].byte_span == (4, 20)  # inside the view's 24 bytes


def test_a_view_past_its_root_is_refused(tmp_path: Path) -> None:
    path = legacy_file(tmp_path / "past.pt", ("2", 8, 6), (0, (6,), (1,)))
    with pytest.raises(RuntimeError):
        torch_load(path)  # torch cuts the view at the root's end, then the tensor does not fit
    with pytest.raises(CorruptCheckpointError, match=r"storage view 2 \(6 elements at 8\)"):
        open_checkpoint(path)


def test_a_view_in_a_zip_archive_is_refused(tmp_path: Path) -> None:
    """torch's zip reader takes five-field storage ids only; a sixth is not read as a view."""
    src = tmp_path / "plain.pt"
    torch.save({"w": torch.arange(4.0)}, src)
    tree = open_checkpoint(src).root

    def with_view(storage: StorageRef) -> tuple[Any, ...]:
        return ("storage", storage.storage_type, storage.key, "cpu", storage.numel, ("v", 0, 4))

    dst = tmp_path / "view.pt"
    tools().rewrite_zip(src, dst, replace={"data.pkl": dumps(tree, 2, with_view)})
    with pytest.raises(ValueError):
        torch.load(dst, weights_only=False)
    with pytest.raises(CorruptCheckpointError, match="legacy storage view"):
        open_checkpoint(dst)


@pytest.mark.parametrize(
    ("view", "geometry"),
    [(("0", 4, 6), (0, (6,), (1,))), (("9", 4, 6), (0, (6,), (1,)))],
    ids=["view-key-is-its-root-key", "distinct-keys"],
)
def test_a_view_key_torch_would_take_for_another_storage_is_refused(
    tmp_path: Path, view: tuple[str, int, int], geometry: tuple[Any, ...]
) -> None:
    path = legacy_file(tmp_path / "keys.pt", view, geometry)
    loaded = torch_load(path)
    if view[0] == "0":  # torch takes the root for the view: another tensor than its view's
        assert torch.equal(loaded["on_view"], torch.arange(6.0))
        with pytest.raises(CorruptCheckpointError, match="both a storage's and a storage view"):
            open_checkpoint(path)
    else:
        ckpt = open_checkpoint(path)
        got = value_bytes(tensor_from_span(ckpt, ckpt.root["on_view"]))
        assert got.equal(value_bytes(loaded["on_view"]))


def test_a_torch_output_of_a_view_names_the_way_that_works(tmp_path: Path) -> None:
    import ckpt_tools as ct
    from ckpt_tools.errors import ConversionError

    path = legacy_file(tmp_path / "view.pt", ("2", 4, 6), (1, (2, 2), (1, 2)))
    with pytest.raises(ConversionError, match=r"torch\.load it with a current torch"):
        ct.convert(path, tmp_path / "out.pt")
    ct.convert(path, tmp_path / "out.safetensors")  # the other way it names
    torch.save(torch_load(path), tmp_path / "resaved.pt")  # the way it names: a zip archive
    ct.convert(tmp_path / "resaved.pt", tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt")["on_view"], torch_load(path)["on_view"])
