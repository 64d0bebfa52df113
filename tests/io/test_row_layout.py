"""A tensor whose rows lie back to back in their own order (``channels_last``): its layout
told from its strides, and its storage bytes put in row-major order, against torch's own
``contiguous()`` of every memory format and of views that have no such layout."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from ckpt_tools.descriptors import StorageRef, TensorRef
from ckpt_tools.io.row_layout import from_row_major, row_layout, row_major_stream, to_row_major


def _ref(t: torch.Tensor) -> TensorRef:
    storage = StorageRef("0", "float32", t.untyped_storage().nbytes(), "cpu")
    return TensorRef(storage, t.storage_offset(), tuple(t.shape), t.stride(), "float32")


def _storage_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.untyped_storage())


LAID_OUT = {
    "row-major": lambda x: x,
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "channels_last, 1x1": lambda x: x[:, :, :1, :1].contiguous(memory_format=torch.channels_last),
    "one row": lambda x: x[:1].contiguous(memory_format=torch.channels_last),
    "permuted inside rows": lambda x: x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1),
    "3-d": lambda x: x.flatten(2).transpose(1, 2).contiguous().transpose(1, 2),
}


@pytest.mark.parametrize("name", list(LAID_OUT))
def test_a_tensor_filling_its_storage_row_after_row_is_read_as_torch_reads_it(name: str) -> None:
    t = LAID_OUT[name](torch.randn(5, 3, 4, 2))
    ref = _ref(t)
    assert row_layout(ref) is not None
    memory = np.frombuffer(_storage_bytes(t), np.uint32).reshape(t.shape[0], -1)
    want = np.frombuffer(t.contiguous().numpy().tobytes(), np.uint32).reshape(memory.shape)
    assert np.array_equal(to_row_major(memory, ref), want)
    assert np.array_equal(from_row_major(want, ref), memory)


@pytest.mark.parametrize("name", list(LAID_OUT))
@pytest.mark.parametrize("chunk", [1, 7, 96, 1 << 20])
def test_storage_bytes_in_any_chunks_stream_out_row_major(name: str, chunk: int) -> None:
    t = LAID_OUT[name](torch.randn(5, 3, 4, 2))
    data = _storage_bytes(t)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(data), chunk):
            yield data[start : start + chunk]

    assert b"".join(row_major_stream(chunks(), _ref(t))) == t.contiguous().numpy().tobytes()


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.flatten(1).t(),  # transposed: the first dimension is not the outermost
        lambda x: x[:, :, ::2],  # strided
        lambda x: x[:, :1].expand(5, 3, 4, 2),  # expanded
    ],
    ids=["transposed", "strided", "expanded"],
)
def test_a_view_whose_rows_are_not_back_to_back_has_no_row_layout(
    view: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    assert row_layout(_ref(view(torch.randn(5, 3, 4, 2)))) is None


def test_a_stream_ending_inside_a_row_is_refused() -> None:
    t = torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="ended inside a row"):
        list(row_major_stream([_storage_bytes(t)[:-4]], _ref(t)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(4, 0),  # as Linear(0, 4).weight: strides (1, 1)
        lambda: torch.empty(3, 0, 2),
        lambda: torch.empty(2, 0, 3, 3).contiguous(memory_format=torch.channels_last),
        lambda: torch.empty(2, 0, 3, 2, 2).contiguous(memory_format=torch.channels_last_3d),
    ],
    ids=["linear-in-0", "middle-0", "channels_last", "channels_last_3d"],
)
def test_a_tensor_of_no_elements_is_row_major_whatever_its_strides(make: Callable) -> None:
    t = make()
    assert t.numel() == 0
    assert row_layout(_ref(t)) == tuple(range(1, t.dim()))
