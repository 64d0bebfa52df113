"""A lazy module (``nn.LazyLinear``, ``nn.LazyBatchNorm1d``) takes the shapes of the state dict
loaded into it, as torch's ``load_state_dict`` materializes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ckpt_tools as ct


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(4)
        self.bn = nn.LazyBatchNorm1d()


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)


@pytest.mark.parametrize("prefix", ["", "module."])
def test_a_lazy_model_is_loaded_as_torch_loads_it(tmp_path: Path, prefix: str) -> None:
    torch.manual_seed(0)
    source = _Plain()
    source.bn.running_mean.normal_()
    path = tmp_path / "plain.pt"
    torch.save({prefix + k: v for k, v in source.state_dict().items()}, path)

    oracle = _Lazy()
    oracle.load_state_dict(source.state_dict())  # torch materializes the lazy parameters
    ours = _Lazy()
    info = ct.load_into(ours, path)

    assert not info.missing and not info.unexpected
    want, got = oracle.state_dict(), ours.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and torch.equal(got[key], value), key
    assert not any(nn.parameter.is_lazy(p) for p in ours.parameters())


def test_a_lazy_models_own_state_dict_is_its_state_dict(tmp_path: Path) -> None:
    # Before its first forward a lazy module's state dict holds UninitializedParameter and
    # UninitializedBuffer objects: torch.load(weights_only=True) refuses them, trust loads them.
    path = tmp_path / "lazy.pt"
    torch.save(_Lazy().state_dict(), path)
    with pytest.raises(ct.UnsafeContentError, match="UninitializedParameter") as info:
        ct.load_state_dict(path)
    assert "trust=True" in str(info.value)
    with pytest.raises(Exception, match="Unsupported global"):
        torch.load(path, weights_only=True)
    want = torch.load(path, weights_only=False)
    got = ct.load_state_dict(path, trust=True)
    assert list(got) == list(want)
    assert [type(v) for v in got.values()] == [type(v) for v in want.values()]
    oracle, ours = _Lazy(), _Lazy()
    oracle.load_state_dict(want)
    ct.load_into(ours, path, trust=True)
    assert [type(p) for p in ours.parameters()] == [type(p) for p in oracle.parameters()]
    assert ct.inspect(path).selected == ()
