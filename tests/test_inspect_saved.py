"""``inspect`` on checkpoints saved by the test itself with ``torch.save`` to a path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_tools
from ckpt_tools.formats import open_checkpoint
from tests.helpers import describe, tools

FORMATS = {
    "zip": ({}, "torch-zip"),
    "legacy": ({"_use_new_zipfile_serialization": False}, "torch-legacy"),
}


@pytest.mark.parametrize("kind", FORMATS)
def test_parameters_and_buffers(make_checkpoint: Callable[..., Path], kind: str) -> None:
    torch.manual_seed(0)
    obj = {
        "weight": nn.Parameter(torch.randn(3, 2)),
        "frozen": nn.Parameter(torch.randn(2), requires_grad=False),
        "running_mean": torch.zeros(3),
    }
    save_kwargs, fmt = FORMATS[kind]
    path = make_checkpoint(obj, f"params_{kind}.pt", **save_kwargs)
    loaded = torch.load(path, weights_only=True)
    info = ckpt_tools.inspect(path)
    assert info.format == fmt
    for t in info.tensors:
        assert t.is_parameter == isinstance(loaded[t.name], nn.Parameter), t.name
        assert (t.dtype, t.shape, t.stride) == tuple(
            describe(loaded[t.name])[k] for k in ("dtype", "shape", "stride")
        )
    refs = open_checkpoint(path).root
    assert {k: v.requires_grad for k, v in refs.items()} == {
        k: v.requires_grad for k, v in loaded.items()
    }


def test_zip_saved_to_a_path_is_rooted_at_its_stem(make_checkpoint: Callable[..., Path]) -> None:
    """``torch.save(obj, "model_best.pth")`` names the zip's folder ``model_best``."""
    sd: dict[str, Any] = tools().state_dict()
    path = make_checkpoint({"state_dict": sd, "epoch": 1}, "model_best.pth")
    ckpt = open_checkpoint(path)
    assert ckpt.archive_root == path.stem
    info = ckpt_tools.inspect(path)
    assert info.selected == ("state_dict",)
    assert [t.name for t in info.tensors] == list(torch.load(path, weights_only=True)["state_dict"])
