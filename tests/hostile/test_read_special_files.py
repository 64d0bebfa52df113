"""FIFOs, sockets, devices (and symlinks to them) are refused at once.

Every path is checked with ``os.stat`` before it is opened, shard files named by an index
too; a reader that opened a FIFO would block until killed, which the timeouts here catch.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from safetensors.numpy import save_file

from ckpt_tools.errors import UnsupportedFormatError
from tests.helpers.cli import assert_refused_alike


def _refused(path: Path, kind: str) -> None:
    assert_refused_alike(path, UnsupportedFormatError, kind, kind)


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
