"""Inspecting never runs a checkpoint's pickle, and ``ckpt inspect`` never imports torch."""

from __future__ import annotations

import argparse
import json
import pickle
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.cli.main import main
from tests.helpers import (
    entry,
    fixture_path,
    read_data_pkl,
    run_ckpt,
    tools,
)

EVIL = fixture_path("evil.pt")
MARKER = tools().MARKER


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in tmp_path, where the evil command would create its marker."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_evil_fixture_is_really_evil(tmp_path: Path) -> None:
    """Control: loading it the unsafe way does run the command (in a scratch folder)."""
    data = read_data_pkl(EVIL)
    assert b"posix\nsystem" in data and f"touch {MARKER}".encode() in data
    script = f"import torch; torch.load({str(EVIL)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=120)
    assert (tmp_path / MARKER).exists()


def test_inspect_reports_and_never_runs_it(in_tmp: Path) -> None:
    info = ckpt_tools.inspect(EVIL)
    assert not (in_tmp / MARKER).exists()
    assert info.unsafe_globals == ("posix.system",)
    assert "posix.system" in info.entries["payload"]
    assert list(info.selected) == entry("evil.pt")["select"]
    expected = ckpt_tools.inspect(fixture_path("plain.pt"))
    assert [t.name for t in info.tensors] == [t.name for t in expected.tensors]


def test_torch_weights_only_refuses_it_too(in_tmp: Path) -> None:
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
        torch.load(EVIL, weights_only=True)
    assert not (in_tmp / MARKER).exists()


def test_cli_reports_it(
    in_tmp: Path, fixture_copy: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    fixture_copy("evil.pt")
    assert main(["inspect", "evil.pt"]) == 0  # a path relative to the folder with the marker
    text = capsys.readouterr().out
    assert "unsafe:" in text and "posix.system" in text
    assert "`ckpt scan evil.pt`" in text  # where the verdict is
    assert main(["inspect", "evil.pt", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unsafe_globals"] == ["posix.system"]
    assert not (in_tmp / MARKER).exists()


# ---------------------------------------------------------------------------------------------
# `ckpt inspect` without torch


def test_fake_torch_blocks_imports(no_torch_env: dict[str, str]) -> None:
    """Control: with that PYTHONPATH, importing torch fails."""
    run = subprocess.run(
        [sys.executable, "-c", "import torch"], env=no_torch_env, capture_output=True, text=True
    )
    assert run.returncode != 0 and "must not import torch" in run.stderr


@pytest.mark.parametrize(
    "name", ["plain.pt", "legacy.pt", "model.safetensors", "tar_format.pt", "evil.pt"]
)
def test_inspect_runs_without_torch(name: str, no_torch_env: dict[str, str]) -> None:
    path = fixture_path(name)
    run = run_ckpt("inspect", path, "--json", how="module", env=no_torch_env)
    assert run.returncode == 0, run.stderr
    # The same answer as in this process (where test_inspect_fixtures checks it against torch).
    report = json.loads(run.stdout)
    assert report == ckpt_tools.inspect(path).to_json()
    assert report["tensors"]


def test_suggested_commands_name_the_file_as_one_shell_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A name with a space that starts with "-", pasted as printed, is that file.
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, "-a b.pt")
    text = ckpt_tools.inspect("-a b.pt").text(for_cli=True)
    command = next(part for part in text.split("`") if part.startswith("ckpt scan"))
    assert shlex.split(command) == ["ckpt", "scan", "./-a b.pt"]
