"""The safetensors writer refuses what the format cannot hold before writing a byte.

Plans check while planning; the writer checks again with the same function, so a plan that
skipped the check still cannot write a file whose values or header are wrong.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import ConversionError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.writers.safetensors import (
    SafetensorsEntry,
    check_holdable,
    source_records,
    write_safetensors,
)
from tests import helpers as h


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    tensors = {"n": torch.randn(3)._neg_view(), "w": torch.randn(2), "q": torch.randn(2)}
    return h.save(tensors, tmp_path / "in.pt")


@pytest.mark.parametrize(
    ("rename", "says"),
    [
        ({"w": "__metadata__"}, "reserves the name '__metadata__'"),
        ({"n": "n"}, "tensor 'n' is saved as a negative view"),
    ],
    ids=["reserved-name", "negative-view"],
)
def test_the_writer_refuses_before_writing(
    saved: Path, tmp_path: Path, rename: dict[str, str], says: str
) -> None:
    ckpt = open_checkpoint(saved)
    names = [(rename[k], t) for k, t in ckpt.root.items() if k in rename]
    entries = source_records([SafetensorsEntry(k, t) for k, t in names], ckpt)
    with open(tmp_path / "o.safetensors", "w+b") as f, pytest.raises(ConversionError, match=says):
        write_safetensors(entries, f, durable=False)
    assert (tmp_path / "o.safetensors").stat().st_size == 0


def test_every_offender_is_named_in_one_message(saved: Path) -> None:
    ckpt = open_checkpoint(saved)
    root = ckpt.root
    tensors = [("__metadata__", root["w"]), ("n", root["n"]), ("w\ud800", root["q"])]
    with pytest.raises(ConversionError) as info:
        check_holdable(tensors, ckpt.path)
    said = str(info.value)
    assert "reserves the name '__metadata__'" in said
    assert "tensor 'n' is saved as a negative view" in said
    assert "1 name(s)" in said and "'w\\ud800'" in said
    assert "regex_rule(PATTERN, 'NEW')" in said and "resolve_neg()" in said
