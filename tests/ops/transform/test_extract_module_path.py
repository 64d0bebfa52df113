"""``extract``'s prefix is a module path: ``layer1`` is not ``layer10`` nor ``layer1x``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools import UsageError
from ckpt_tools.cli.main import main


def _siblings(path: Path, *, plain: bool = False) -> Path:
    state = {
        "layer1.w": torch.ones(2),
        "layer1.sub.b": torch.zeros(3),
        "layer10.w": torch.full((2,), 10.0),
        "layer1x.w": torch.ones(1),
        "head.w": torch.ones(3),
    }
    if plain:
        state["layer1"] = torch.tensor(5.0)
    torch.save(state, path)
    return path


@pytest.mark.parametrize("prefix", ["layer1", "layer1."])
def test_the_prefix_takes_its_module_only(tmp_path: Path, prefix: str) -> None:
    src = _siblings(tmp_path / "in.pt")
    ct.extract(src, tmp_path / "o.safetensors", prefix=prefix, strip_prefix=True)
    assert list(load_file(tmp_path / "o.safetensors")) == ["w", "sub.b"]
    ct.extract(src, tmp_path / "k.pt", prefix=prefix)
    assert list(torch.load(tmp_path / "k.pt", weights_only=True)) == ["layer1.w", "layer1.sub.b"]


def test_a_key_equal_to_the_prefix_is_kept_unstripped(tmp_path: Path) -> None:
    src = _siblings(tmp_path / "in.pt", plain=True)
    ct.extract(src, tmp_path / "o.pt", prefix="layer1")
    kept = torch.load(tmp_path / "o.pt", weights_only=True)
    assert list(kept) == ["layer1.w", "layer1.sub.b", "layer1"]


def test_stripping_a_key_to_nothing_is_refused_and_nothing_written(tmp_path: Path) -> None:
    src = _siblings(tmp_path / "in.pt", plain=True)
    with pytest.raises(UsageError, match="empty key") as caught:
        ct.extract(src, tmp_path / "o.pt", prefix="layer1", strip_prefix=True)
    assert "'layer1'" in str(caught.value) and "--" not in str(caught.value)
    assert not (tmp_path / "o.pt").exists()


def test_the_cli_takes_the_module_and_refuses_an_empty_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _siblings(tmp_path / "in.pt")
    args = ["extract", str(src), str(tmp_path / "o.pt"), "--prefix", "layer1", "--strip-prefix"]
    assert main([*args, "-q"]) == 0
    assert list(torch.load(tmp_path / "o.pt", weights_only=True)) == ["w", "sub.b"]
    plain = _siblings(tmp_path / "plain.pt", plain=True)
    args = ["extract", str(plain), str(tmp_path / "p.pt"), "--prefix", "layer1", "--strip-prefix"]
    assert main(args) == 2
    assert "empty key for 'layer1'" in capsys.readouterr().err
    assert not (tmp_path / "p.pt").exists()
