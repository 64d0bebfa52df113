"""A pickled ``nn.Module``'s recovered state dict holds tensors as ``model.state_dict()`` gives
them: detached plain tensors (no ``nn.Parameter``, no ``requires_grad``), tied ones sharing
memory.

The oracle is ``torch.load(weights_only=False)`` of the same file, then ``.state_dict()``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ckpt_tools.loading.state_dict import load_state_dict


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5), nn.BatchNorm1d(5))
    model[1].weight = model[0].weight  # tied
    model[2].bias.requires_grad_(False)
    # A buffer saved while it requires grad: state_dict() detaches it too.
    model[2].register_buffer("scale", torch.ones(5, requires_grad=True))
    return model


def test_recovered_tensors_are_what_state_dict_gives(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(_model(), path)
    want = torch.load(path, weights_only=False).state_dict()
    got = load_state_dict(path, map_location="cpu")
    assert list(got) == list(want)
    for key, theirs in want.items():
        ours = got[key]
        assert type(ours) is type(theirs), key
        assert ours.requires_grad == theirs.requires_grad, key
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), key
    assert got["0.weight"].data_ptr() == got["1.weight"].data_ptr()
    got["1.weight"].mul_(2)  # in place, as on a state_dict() tensor
    assert torch.equal(got["0.weight"], want["0.weight"] * 2)
