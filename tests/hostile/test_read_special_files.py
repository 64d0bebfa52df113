"""FIFOs, sockets, devices (and symlinks to them) are refused at once.

Every path is checked with ``os.stat`` before it is opened, shard files named by an index
too; a reader that opened a FIFO would block until killed, which the timeouts here catch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import save_file

from ckpt_tools.errors import UnsupportedFormatError
from ckpt_tools.formats import open_checkpoint

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    # A blocked read would hang: the timeout turns that into a failure, not a stuck suite.
    return subprocess.run([CKPT, *args], capture_output=True, text=True, timeout=30)


def _refused(path: Path, kind: str) -> None:
    with pytest.raises(UnsupportedFormatError, match=kind):
        open_checkpoint(path)
    result = _ckpt("inspect", str(path))
    assert result.returncode == 4, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and kind in lines[0], result.stderr


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    _refused(fifo, "FIFO")


def test_symlink_to_fifo_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "pipe")
    _refused(tmp_path / "model.safetensors", "FIFO")


def test_character_device_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "zero.pt"
    link.symlink_to("/dev/zero")  # reading it would never end
    _refused(link, "character device")


def test_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        _refused(path, "socket")
    finally:
        server.close()


def _index(folder: Path, shard: str) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": shard}}))
    return index


def test_fifo_shard_named_by_an_index_is_refused(tmp_path: Path) -> None:
    import numpy as np

    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "real.safetensors"))
    os.mkfifo(tmp_path / "model-00001.safetensors")
    _index(tmp_path, "model-00001.safetensors")
    _refused(tmp_path, "FIFO")


def test_fifo_named_like_an_index_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    _refused(tmp_path, "FIFO")
