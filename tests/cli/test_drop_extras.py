"""Every command that may write safetensors treats a non-tensor entry alike.

safetensors holds tensors only. Without ``--drop-extras`` the entry is refused (exit 7, nothing
written), and every fix the message names is an option of that command; with it, the output
loads with safetensors' own reader, holds the tensors as torch saved them, and the entry is
listed as left out.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import click
import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.cli.main import cli
from tests import helpers as h
from tests.helpers.lora import write_tiny_adapter

W = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _plain(tmp: Path, key: str = "a.weight", step: str = "step", name: str = "in.pt") -> Path:
    """A state dict of one tensor under ``key``, with a step count under ``step``."""
    path = tmp / name
    torch.save({key: W, step: 3}, path)
    return path


def _dcp(tmp: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # (saving without a process group warns)
        warnings.simplefilter("ignore")
        dcp.save({"model": {"a.weight": W, "step": 3}}, checkpoint_id=str(tmp / "run"))
    return tmp / "run"


def _merge(tmp: Path) -> list[object]:
    sd = torch.load(h.FIXTURES / "plain.pt", weights_only=True)
    torch.save({**sd, "step": 3}, tmp / "base.pt")
    return ["merge-lora", tmp / "base.pt", write_tiny_adapter(tmp / "lora")]


#: command -> what comes before OUT, built in a temp folder.
CASES: dict[str, Callable[[Path], list[object]]] = {
    "strip-module": lambda t: ["strip-module", _plain(t, "module.a.weight")],
    "add-module": lambda t: ["add-module", _plain(t)],
    "rename": lambda t: ["rename", "--sub", "a.=b.", _plain(t)],
    "convert": lambda t: ["convert", _plain(t)],
    "slim": lambda t: ["slim", "--dtype", "bf16", _plain(t)],
    "extract": lambda t: ["extract", "--prefix", "enc.", _plain(t, "enc.a.weight", "enc.step")],
    "average": lambda t: ["average", _plain(t, name="a.pt"), _plain(t, name="b.pt")],
    "merge-lora": _merge,
    "consolidate": lambda t: ["consolidate", _dcp(t)],
}


def _flags(command: str) -> set[str]:
    found = cli.get_command(click.Context(cli), command)
    assert found is not None
    return {o for p in found.params if isinstance(p, click.Option) for o in p.opts}


@pytest.mark.parametrize("command", sorted(CASES))
def test_a_non_tensor_entry_is_refused_or_left_out_alike(command: str, tmp_path: Path) -> None:
    args = CASES[command](tmp_path)
    out = tmp_path / "out.safetensors"

    _, _, stderr = h.run_ckpt(*args, out, code=7)
    assert "safetensors holds tensors only" in stderr and "step" in stderr, stderr
    named = set(re.findall(r"pass (--[a-z-]+)", stderr))
    assert "--drop-extras" in named and named <= _flags(command), (named, stderr)
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors*"))

    _, stdout, _ = h.run_ckpt(*args, out, "--drop-extras", "--verify", "full")
    assert re.search(r"^left out: .*step", stdout, re.M), stdout
    got = load_file(out)
    assert got and not any(k.endswith("step") for k in got)
    if command != "merge-lora":  # (its tensors are the merge, checked against PEFT elsewhere)
        expected = W.to(torch.bfloat16) if command == "slim" else W
        assert all(torch.equal(v, expected) for k, v in got.items() if k.endswith("a.weight"))


def test_slim_names_weights_only_where_it_is_the_fix(tmp_path: Path) -> None:
    """Entries beside the state dict: --weights-only fixes it; inside it, only --drop-extras."""
    torch.save({"model": {"a.weight": W}, "epoch": 1}, tmp_path / "beside.pt")
    _, _, stderr = h.run_ckpt("slim", tmp_path / "beside.pt", tmp_path / "o.safetensors", code=7)
    assert "pass --weights-only" in stderr and "1 non-tensor entry: epoch" in stderr, stderr

    torch.save({"model": {"a.weight": W, "step": 3}}, tmp_path / "inside.pt")
    args = ("slim", tmp_path / "inside.pt", tmp_path / "o.safetensors", "--weights-only")
    _, _, stderr = h.run_ckpt(*args, code=7)
    assert "--weights-only" not in stderr and "pass --drop-extras" in stderr, stderr
