"""Malformed jagged nested tensors: refused where torch.load(weights_only=True) refuses them,
and where reading them would reach outside their values' storage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nested._internal.nested_tensor import NestedTensor, _rebuild_njt

import ckpt_tools as ct
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests.formats.pickle.test_jagged import torch_outcomes
from tests.helpers.committed import tools


class _Njt:
    """Pickled as torch.save pickles a jagged tensor, from the arguments given."""

    def __init__(self, kwargs: dict[str, Any], state: dict[str, Any]) -> None:
        self.kwargs, self.state = kwargs, state

    def __reduce_ex__(self, proto: int) -> tuple[Any, ...]:
        call = (_rebuild_njt, NestedTensor, (self.kwargs,), self.state)
        return (torch._tensor._rebuild_from_type_v2, call)


def _kwargs(**changed: Any) -> dict[str, Any]:
    kwargs = {
        "values": torch.arange(16.0).reshape(8, 2),
        "offsets": torch.tensor([0, 3, 8]),
        "lengths": None,
        "_ragged_idx": 1,
        "_metadata_cache": {},
        "requires_grad": False,
    }
    return {**kwargs, **changed}


def _state(kwargs: dict[str, Any], **changed: Any) -> dict[str, Any]:
    names = ("values", "offsets", "lengths", "_ragged_idx", "_metadata_cache")
    return {**{f"_{n.lstrip('_')}": kwargs[n] for n in names}, **changed}


def _saved(path: Path, kwargs: dict[str, Any], state: dict[str, Any] | None = None) -> Path:
    torch.save(
        {"w": torch.ones(2), "n": _Njt(kwargs, _state(kwargs) if state is None else state)}, path
    )
    return path


def test_arguments_torch_refuses_are_refused(tmp_path: Path) -> None:
    files = {
        "2-d offsets": _saved(tmp_path / "a.pt", _kwargs(offsets=torch.tensor([[0, 3, 8]]))),
        "lengths per component": _saved(tmp_path / "b.pt", _kwargs(lengths=torch.tensor([3]))),
        "no offsets": _saved(tmp_path / "c.pt", _kwargs(offsets=None)),
    }
    outcomes = torch_outcomes(*files.values())
    assert all(o["error"] and not o["unsafe"] for o in outcomes), outcomes
    for path in files.values():
        with pytest.raises(CorruptCheckpointError, match="jagged nested tensor"):
            open_checkpoint(path)
        with pytest.raises(CorruptCheckpointError):
            ct.inspect(str(path))


def test_a_state_that_swaps_its_offsets_is_refused(tmp_path: Path) -> None:
    # torch sets the state's _offsets on the tensor after its constructor checked its own:
    # the tensor read would not be the one described.
    kwargs = _kwargs()
    state = _state(kwargs, _offsets=torch.tensor([0, 3, 80]))
    path = _saved(tmp_path / "swapped.pt", kwargs, state)
    assert torch_outcomes(path) == [{"error": "", "unsafe": []}]
    with pytest.raises(CorruptCheckpointError, match="_offsets is not its constructor's"):
        open_checkpoint(path)


def _offsets_record(path: Path) -> str:
    return open_checkpoint(path).root["n"].args[2][0]["offsets"].storage.key


def test_offsets_past_the_values_are_refused_where_the_values_are_read(tmp_path: Path) -> None:
    src = tmp_path / "njt.pt"
    values = torch.arange(16.0).reshape(8, 2)
    torch.save({"n": torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3, 8]))}, src)
    bad = tmp_path / "bad.pt"
    # The second component ends at row 9 of 8: torch loads the file, and its kernels would
    # read past the values' storage.
    moved = torch.tensor([0, 3, 9]).numpy().tobytes()
    tools().rewrite_zip(src, bad, replace={f"data/{_offsets_record(src)}": moved})
    assert torch_outcomes(bad) == [{"error": "", "unsafe": []}]
    assert [t.layout for t in ct.inspect(str(bad)).tensors] == ["jagged"]
    with pytest.raises(CorruptCheckpointError, match="ends at row 9 of its 8-row values"):
        ct.diff(src, bad)


def test_truncated_values_are_refused_as_torch_refuses_them(tmp_path: Path) -> None:
    src = tmp_path / "njt.pt"
    values = torch.arange(16.0).reshape(8, 2)
    torch.save({"n": torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3, 8]))}, src)
    key = open_checkpoint(src).root["n"].parts[0].storage.key
    bad = tmp_path / "bad.pt"
    tools().rewrite_zip(src, bad, replace={f"data/{key}": values.numpy().tobytes()[:40]})
    assert torch_outcomes(bad)[0]["error"]
    with pytest.raises(CorruptCheckpointError):
        ct.diff(src, bad)
    with pytest.raises(CorruptCheckpointError):
        ct.slim(bad, tmp_path / "out.pt")
