"""A shard path must stay inside its folder; nothing outside is opened.

The file "outside" is a FIFO: had anything opened it, the read would block and the
subprocess timeout would fail the test, so these tests also prove it was never opened.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests.helpers.cli import assert_refused_alike

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CKPT, *args], capture_output=True, text=True, timeout=30)


def _folder(tmp_path: Path, shard: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": np.zeros(2, np.float32)}, str(folder / "inside.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    return folder


def _outside(tmp_path: Path) -> Path:
    target = tmp_path / "outside.safetensors"
    os.mkfifo(target)
    return target


def _refused(folder: Path, words: str) -> None:
    assert_refused_alike(folder, CorruptCheckpointError, words, "shards must lie")


def test_parent_relative_shard_is_refused(tmp_path: Path) -> None:
    _outside(tmp_path)
    _refused(_folder(tmp_path, "../outside.safetensors"), "not a file name inside its folder")


def test_absolute_shard_is_refused(tmp_path: Path) -> None:
    target = _outside(tmp_path)
    _refused(_folder(tmp_path, str(target)), "not a file name inside its folder")


def test_symlink_leading_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    target = _outside(tmp_path)
    folder = _folder(tmp_path, "shard.safetensors")
    (folder / "shard.safetensors").symlink_to(target)
    _refused(folder, "symlink that leads out of its folder")


def test_single_weight_file_symlinked_outside_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(target))
    folder = tmp_path / "single"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(target)
    with pytest.raises(CorruptCheckpointError, match="leads out of its folder") as info:
        open_checkpoint(folder)
    # The way on is named: the linked file opens by its own path.
    assert "open a linked file by its own path" in str(info.value)
    assert open_checkpoint(folder / "model.safetensors").format == "safetensors"


def test_symlink_inside_the_folder_and_hub_cache_blobs_open(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot links each file to ../../blobs: that layout still opens."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    save_file({"w": np.ones(2, np.float32)}, str(repo / "blobs" / "f00d"))
    (snapshot / "model-00001.safetensors").symlink_to("../../blobs/f00d")
    index = {"weight_map": {"w": "model-00001.safetensors"}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    assert list(open_checkpoint(snapshot).root) == ["w"]
    assert _ckpt("inspect", str(snapshot)).returncode == 0
