"""extract's stripped prefix leaves the module versions (``_metadata``) as torch's
``consume_prefix_in_state_dict_if_present`` leaves them, so the submodule loads as itself."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import ckpt_tools as ct


def _torch_stripped(sd: OrderedDict, prefix: str) -> OrderedDict:
    sub = OrderedDict((k, v) for k, v in sd.items() if k.startswith(prefix))
    sub._metadata = OrderedDict(sd._metadata)  # type: ignore[attr-defined]
    consume_prefix_in_state_dict_if_present(sub, prefix)
    return sub


def test_strip_prefix_moves_the_module_version_to_the_root(tmp_path: Path) -> None:
    sd = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).state_dict()
    torch.save(sd, tmp_path / "in.pt")
    ct.extract(tmp_path / "in.pt", tmp_path / "out.pt", prefix="1.", strip_prefix=True)
    ours = torch.load(tmp_path / "out.pt", weights_only=True)
    want = _torch_stripped(sd, "1.")
    assert list(ours) == list(want)
    assert ours._metadata == want._metadata
    # BatchNorm reads the root's version: before 2, a missing num_batches_tracked is filled in.
    assert _missing_on_load(ours) == _missing_on_load(want) == ["num_batches_tracked"]


def _missing_on_load(state: OrderedDict) -> list[str]:
    trimmed = OrderedDict((k, v) for k, v in state.items() if k != "num_batches_tracked")
    trimmed._metadata = state._metadata  # type: ignore[attr-defined]
    return nn.BatchNorm1d(2).load_state_dict(trimmed, strict=False).missing_keys


def test_a_wrapped_submodule_loads_with_its_own_version(tmp_path: Path) -> None:
    model = nn.Module()
    model.module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    torch.save(model.state_dict(), tmp_path / "in.pt")
    ct.extract(tmp_path / "in.pt", tmp_path / "out.pt", prefix="module.1", strip_prefix=True)
    ours = torch.load(tmp_path / "out.pt", weights_only=True)
    own = model.module[1].state_dict()  # what the BatchNorm itself saves
    assert ours._metadata[""] == own._metadata[""]
    assert _missing_on_load(ours) == _missing_on_load(own) == ["num_batches_tracked"]


def test_without_strip_the_metadata_is_kept(tmp_path: Path) -> None:
    sd = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).state_dict()
    torch.save(sd, tmp_path / "in.pt")
    ct.extract(tmp_path / "in.pt", tmp_path / "s.pt", prefix="1", strip_prefix=True)
    ct.extract(tmp_path / "in.pt", tmp_path / "k.pt", prefix="1")
    kept = torch.load(tmp_path / "k.pt", weights_only=True)
    assert kept._metadata == sd._metadata
    assert torch.load(tmp_path / "s.pt", weights_only=True)._metadata == (
        _torch_stripped(sd, "1.")._metadata
    )
