"""Our allowlist against torch's: every global torch.load(weights_only=True) admits in a fresh
process after ``import torch`` is resolved by our reader, as torch treats it, and one more:
the ``_DimRange`` that ``import torch._dynamo`` admits, as loading a jagged tensor needs."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.formats.pickle.allowlist import ALLOWED_GLOBALS, resolve_allowed
from ckpt_tools.formats.pickle.standins import ConstantRef
from ckpt_tools.ops.scan.severity import classify
from tests.helpers.child_oracle import torchs_allowlists

# The globals torch admits that we deliberately resolve otherwise: none today. A name added
# here needs its reason (and the reader must still refuse it by name, never guess).
_TREATED_DIFFERENTLY: dict[str, str] = {}

# Taken from what ``import torch._dynamo`` adds: torch's refusal of a jagged tensor saved by
# ``torch.nested.nested_tensor`` asks for that import. Only this one; the DTensor classes
# the import also adds are not.
_DIM_RANGE = "torch._dynamo.decorators._DimRange"


def test_our_allowlist_is_exactly_torchs() -> None:
    theirs, with_dynamo = torchs_allowlists()
    missing = sorted(theirs - ALLOWED_GLOBALS - _TREATED_DIFFERENTLY.keys())
    assert missing == [], f"torch admits globals our reader does not resolve: {missing}"
    assert _DIM_RANGE in with_dynamo - theirs
    assert sorted(ALLOWED_GLOBALS - theirs) == [_DIM_RANGE]
    others = with_dynamo - theirs - {_DIM_RANGE}  # the DTensor classes: still refused
    assert others and all(resolve_allowed(*n.rsplit(".", 1)) is None for n in others)
    assert all(resolve_allowed(*n.rsplit(".", 1)) is not None for n in ALLOWED_GLOBALS)
    assert {n for n in theirs | {_DIM_RANGE} if classify(n).severity != "allowed"} == set()


def _saved(tmp_path: Path, value: object) -> Path:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.arange(3.0), "v": value}, path)
    return path


@pytest.mark.parametrize(
    "value",
    [torch.uint4, torch.int3, torch.sparse.FloatTensor, torch.cuda.sparse.ByteTensor],
    ids=["uint4", "int3", "sparse", "cuda-sparse"],
)
def test_torchs_constants_are_values(tmp_path: Path, value: object) -> None:
    path = _saved(tmp_path, value)
    torch.load(path, weights_only=True)
    assert ct.inspect(str(path)).unsafe_globals == ()
    name = f"{value.__module__}.{value.__name__}" if isinstance(value, type) else str(value)
    assert resolve_allowed(*name.rsplit(".", 1)) == ConstantRef(*name.rsplit(".", 1))


class _OnDevice:
    """Pickles as torch.save pickles a tensor of a backend without storages (xla)."""

    def __init__(self, *args: object) -> None:
        self.args = args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return torch._utils._rebuild_device_tensor_from_cpu_tensor, self.args


def test_a_device_tensor_is_its_cpu_copy_with_its_device_tag(tmp_path: Path) -> None:
    path = _saved(tmp_path, _OnDevice(torch.arange(4.0), torch.float16, "cpu", True))
    assert torch.load(path, weights_only=True)["v"].dtype == torch.float16
    found = ct.inspect(str(path))
    assert found.unsafe_globals == ()
    tensor = found.tensor("v")
    assert (tensor.shape, tensor.dtype, tensor.device) == ((4,), "float16", "cpu")


@pytest.mark.parametrize(
    "args",
    [
        (torch.float32, "cpu", 1),
        (torch.int64, "cpu", True),
        (torch.float32, "nowhere", False),
    ],
    ids=["int-flag", "int-requires-grad", "bad-device"],
)
def test_a_device_tensor_torch_refuses_is_refused(tmp_path: Path, args: tuple) -> None:
    path = _saved(tmp_path, _OnDevice(torch.arange(4.0), *args))
    with pytest.raises((RuntimeError, TypeError, pickle.UnpicklingError)):
        torch.load(path, weights_only=True)
    with pytest.raises(
        ct.CorruptCheckpointError, match=r"_rebuild_device_tensor_from_cpu_tensor|device"
    ):
        ct.inspect(str(path))


def test_mesh_layouts_are_read_and_carried(tmp_path: Path) -> None:
    from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

    layouts = [_FlatLayout((2,), (1,)), _MeshLayout([_FlatLayout((2,), (1,))])]
    path = _saved(tmp_path, layouts)
    assert torch.load(path, weights_only=True)["v"] == layouts
    assert ct.inspect(str(path)).unsafe_globals == ()
    assert classify("torch.distributed._mesh_layout._FlatLayout").severity == "allowed"
    out = tmp_path / "out.pt"
    ct.convert(str(path), str(out))
    assert torch.load(out, weights_only=True)["v"] == layouts


def test_a_device_tensor_is_named_as_one_where_safetensors_cannot_hold_it(tmp_path: Path) -> None:
    path = _saved(tmp_path, _OnDevice(torch.arange(4.0), torch.float16, "xla:0", False))
    with pytest.raises(ct.NonTensorEntriesError, match=r"v \(xla:0 device tensor\)"):
        ct.convert(str(path), str(tmp_path / "out.safetensors"))
    out = tmp_path / "out.pt"
    ct.convert(str(path), str(out))
    assert torch.load(out, weights_only=True, map_location="cpu")["v"].dtype == torch.float16
