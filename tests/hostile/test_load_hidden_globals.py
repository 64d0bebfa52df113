"""A global outside the allowlist hidden in a tensor's rebuild arguments refuses the load.

torch.load(weights_only=True) refuses a pickle at the first global it does not allow, wherever
the pickle uses it: as the backward hooks of ``_rebuild_tensor_v2``, inside them, inside a
parameter's rebuild, or in the inner arguments of ``_rebuild_from_type_v2``. The loader must
refuse the same files, naming the global, and still load the benign twin of each.
"""

from __future__ import annotations

import collections
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import UnsafeContentError


class Evil:
    """A class no allowlist holds: pickled as a global of this test module."""


EVIL = f"{__name__}.Evil"
SYSTEM = f"{os.system.__module__}.system"  # posix.system on Linux


def _storage(t: torch.Tensor) -> Any:
    return torch.storage.TypedStorage(
        wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True
    )


def _v2_args(t: torch.Tensor, hooks: Any) -> tuple[Any, ...]:
    return (_storage(t), 0, tuple(t.shape), t.stride(), False, hooks)


def _plain(t: torch.Tensor, hooks: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return torch._utils._rebuild_tensor_v2, _v2_args(t, hooks)


def _parameter(t: torch.Tensor, hooks: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    return torch._utils._rebuild_parameter, (torch.nn.Parameter(t), False, hooks)


def _from_type(t: torch.Tensor, hooks: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    inner = (torch._utils._rebuild_tensor_v2, torch.Tensor, _v2_args(t, hooks), {})
    return torch._tensor._rebuild_from_type_v2, inner


class Rebuilt:
    """Pickles as ``rebuild(*args)``, the way torch.save writes a tensor."""

    def __init__(self, rebuild: Callable[..., Any], t: torch.Tensor, hooks: Any) -> None:
        self.call = rebuild(t, hooks)

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return self.call


REBUILDS = {"v2": _plain, "parameter": _parameter, "from_type": _from_type}
HOOKS = {
    "global": (os.system, SYSTEM),
    "instance": (Evil(), EVIL),
    "inside": (collections.OrderedDict(hook=Evil()), EVIL),
}


def _saved(tmp_path: Path, rebuild: str, hooks: Any, zipped: bool) -> Path:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "hooks.pt"
    entry = Rebuilt(REBUILDS[rebuild], torch.arange(4.0), hooks)
    torch.save({"w": entry}, path, _use_new_zipfile_serialization=zipped)
    return path


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("rebuild", sorted(REBUILDS))
@pytest.mark.parametrize("hooks", sorted(HOOKS))
def test_global_in_rebuild_arguments_refuses_the_load(
    tmp_path: Path, rebuild: str, hooks: str, zipped: bool
) -> None:
    # The benign twin first: the hand-made rebuild call is one torch and the loader both take.
    twin = _saved(tmp_path / "twin", rebuild, collections.OrderedDict(), zipped)
    expected = torch.load(twin, weights_only=True)["w"]
    loaded = ct.load_state_dict(twin, map_location="cpu")["w"]
    assert type(loaded) is type(expected) and torch.equal(loaded, expected)
    value, name = HOOKS[hooks]
    path = _saved(tmp_path, rebuild, value, zipped)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(UnsafeContentError) as caught:
        ct.load_state_dict(path, map_location="cpu")
    assert caught.value.globals == (name,)
    assert f"'w' ({name})" in str(caught.value)


def test_sanitize_names_the_hidden_global_it_leaves_out(tmp_path: Path) -> None:
    src = _saved(tmp_path, "v2", os.system, zipped=True)
    report = ct.sanitize(src, tmp_path / "clean.pt")
    [change] = report.converted
    assert change.path == "w" and SYSTEM in change.was and change.became == "tensor"
    assert torch.equal(torch.load(tmp_path / "clean.pt", weights_only=True)["w"], torch.arange(4.0))
