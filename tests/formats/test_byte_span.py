"""One byte extent per tensor view (``TensorRef.byte_span``), checked against torch.

torch is the oracle: a view's elements are enumerated through torch's own indexing (a
storage of element numbers viewed with the same geometry), and its bytes come from
``tensor.contiguous()``. The views are the odd ones: transposed, expanded (zero strides),
empty, 0-d, at an offset, stepped, permuted, with 16-byte and 1-byte elements.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckpt_tools.descriptors import StorageRef, TensorRef
from ckpt_tools.dtypes import DTYPE_STORAGE_TYPE, itemsize
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.legacy.reader import offset_locator
from ckpt_tools.formats.pickle.repickle import torch_storage_id
from ckpt_tools.io.tensor_bytes import iter_row_major
from ckpt_tools.loading.tensor_io import read_tensor
from tests.helpers import dtype_name, value_bytes


def _base(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(n).to(dtype)


VIEWS: dict[str, Callable[[], torch.Tensor]] = {
    "transposed": lambda: _base(15).view(3, 5).t(),
    "expanded": lambda: _base(4).view(4, 1).expand(4, 3),
    "expanded_scalar": lambda: _base(9)[7].expand(5),
    "empty": lambda: torch.empty(0, 3),
    "empty_at_offset": lambda: _base(10)[5:5],
    "empty_strided": lambda: _base(20).view(4, 5)[:, 5:],
    "zero_d": lambda: torch.tensor(3.5),
    "zero_d_at_offset": lambda: _base(10)[7],
    "offset_slice": lambda: _base(10)[2:6],
    "offset_block": lambda: _base(20).view(4, 5)[1:, 2:],
    "stepped": lambda: _base(20)[1::3],
    "permuted": lambda: _base(24).view(2, 3, 4).permute(2, 0, 1),
    "size_one_odd_stride": lambda: _base(12).as_strided((1, 3), (100, 2), 3),
    "complex_transposed": lambda: _base(6, torch.complex128).view(2, 3).t(),
    "bool_stepped": lambda: (_base(12) % 3 == 0)[::2],
    "bf16_offset_transposed": lambda: _base(30, torch.bfloat16).view(5, 6)[1:, 1:].t(),
}


def expected_span(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte, end byte)`` in the storage, from the element numbers torch indexes."""
    size = t.element_size()
    first = t.storage_offset() * size
    if t.numel() == 0:
        return first, first
    numbers = torch.arange(t.untyped_storage().nbytes() // size)
    touched = numbers.as_strided(t.shape, t.stride(), t.storage_offset())
    assert int(touched.min()) == t.storage_offset(), "strides are never negative"
    return first, (int(touched.max()) + 1) * size


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every view, saved with torch.save (which keeps views and their whole storages)."""
    path = tmp_path_factory.mktemp("views") / "views.pt"
    torch.save({name: make() for name, make in VIEWS.items()}, path)
    return path


@pytest.mark.parametrize("name", VIEWS)
def test_byte_span_of_a_saved_view_is_torchs(name: str, saved: Path) -> None:
    t = VIEWS[name]()
    ref = open_checkpoint(saved).root[name]
    assert (ref.shape, ref.stride, ref.offset) == (tuple(t.shape), t.stride(), t.storage_offset())
    assert ref.byte_span == expected_span(t)


@pytest.mark.parametrize("name", VIEWS)
def test_row_major_bytes_are_torchs_contiguous_bytes(name: str, saved: Path) -> None:
    t = VIEWS[name]()
    want = value_bytes(t).numpy().tobytes()
    ckpt = open_checkpoint(saved)
    ref = ckpt.root[name]
    span = ckpt.span(ref.storage)
    fd = os.open(span.path, os.O_RDONLY)
    try:
        # Pieces smaller than a row (and than an element) split the gather at every level.
        for chunk_bytes in (1, 7, 24, 1 << 20):
            pieces = list(iter_row_major(fd, span.offset, ref, chunk_bytes))
            assert b"".join(pieces) == want, chunk_bytes
            assert all(len(p) <= max(chunk_bytes, itemsize(ref.dtype)) for p in pieces)
    finally:
        os.close(fd)
    # The torch-side reader uses the same span.
    assert torch.equal(value_bytes(read_tensor(ckpt, ref)), value_bytes(t))


def test_byte_span_without_a_file() -> None:
    storage = StorageRef("0", "float32", 20, "cpu")

    def span(offset: int, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, int]:
        return TensorRef(storage, offset, shape, stride, "float32").byte_span

    assert span(2, (3, 4), (1, 3)) == (8, 56)
    assert span(0, (), ()) == (0, 4)
    assert span(5, (0, 4), (4, 1)) == (20, 20)
    assert span(3, (6,), (0,)) == (12, 16)  # an expanded element: one element of storage


def test_a_tensor_past_its_storage_is_refused(tmp_path: Path) -> None:
    """The reader's bounds check uses the same span: one element past the end is refused."""
    from ckpt_tools.errors import CorruptCheckpointError
    from ckpt_tools.formats.pickle.allowlist import checked_tensor, resolve_allowed

    storage = StorageRef("0", "float32", 12, "cpu")
    func = resolve_allowed("torch._utils", "_rebuild_tensor_v2")
    fits = checked_tensor(func, (storage, 0, (3, 4), (4, 1)), storage, "float32", False)
    assert fits.byte_span == (0, 48)
    with pytest.raises(CorruptCheckpointError, match=r"reaches element 12.*holds 12 elements"):
        checked_tensor(func, (storage, 1, (3, 4), (4, 1)), storage, "float32", False)
    view = StorageRef("0", "float32", 12, "cpu", view=("v", 4, 6))
    with pytest.raises(CorruptCheckpointError, match=r"reaches element 6.*holds 6 elements"):
        checked_tensor(func, (view, 0, (7,), (1,)), view, "float32", False)


def test_a_legacy_view_is_located_inside_its_root() -> None:
    locate = offset_locator("old.pt", {"0": 96})
    root = StorageRef("0", "float32", 12, "cpu")
    view = StorageRef("0", "float32", 12, "cpu", view=("2", 4, 6))
    assert (locate(root).offset, locate(root).nbytes) == (96, 48)
    assert (locate(view).offset, locate(view).nbytes) == (96 + 16, 24)


def test_storage_types_are_torchs() -> None:
    """One table: the storage class torch.save names for each dtype, both directions."""
    from torch.storage import _dtype_to_storage_type_map

    assert {dtype_name(d): n for d, n in _dtype_to_storage_type_map().items()} == DTYPE_STORAGE_TYPE


NEW_DTYPES = [torch.uint16, torch.uint32, torch.float8_e4m3fn]


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.bool, torch.int8, torch.complex128, *NEW_DTYPES],
    ids=str,
)
def test_storage_ids_are_what_torch_save_writes(
    dtype: torch.dtype, make_checkpoint: Callable[..., Path]
) -> None:
    """A storage without a pickled class gets the class and count torch.save would write."""
    t = torch.zeros(6, dtype=dtype)
    saved = open_checkpoint(make_checkpoint({"t": t})).root["t"].storage
    bare = StorageRef("t", dtype_name(dtype), 6, "cpu")  # as read from safetensors
    pid = torch_storage_id(bare, "0", "cpu")
    assert pid[0] == "storage" and pid[2:4] == ("0", "cpu")
    assert (pid[1].qualname, pid[4]) == (saved.storage_type.qualname, saved.numel)
