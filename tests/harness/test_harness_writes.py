"""The harness's own checkpoint files: written whole under a temp name and renamed, with the
mode ``torch.save`` gives a new file (a replaced one keeps its own); a write that fails
(a full disk, in the harness's writer or in torch's under DeepSpeed's ``save_checkpoint``)
is the OSError it was, and leaves no part of a file under the name."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_tools.harness.loop import save_whole
from ckpt_tools.harness.zero.strategy import _save_checkpoint
from tests import helpers as h


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_checkpoint_gets_torch_saves_mode_and_a_replaced_one_keeps_its_own(
    tmp_path: Path,
) -> None:
    before = os.umask(0o022)
    try:
        torch.save({"w": torch.ones(2)}, tmp_path / "oracle.pt")
        save_whole({"w": torch.ones(2)}, tmp_path / "bare.pt")
    finally:
        os.umask(before)
    assert _mode(tmp_path / "bare.pt") == _mode(tmp_path / "oracle.pt") == 0o644
    (tmp_path / "bare.pt").chmod(0o640)
    save_whole({"w": torch.zeros(2)}, tmp_path / "bare.pt")
    assert _mode(tmp_path / "bare.pt") == 0o640
    assert torch.equal(torch.load(tmp_path / "bare.pt")["w"], torch.zeros(2))


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only)."""
    yield from h.mounted("tmpfs", tmp_path / "small", "-t", "tmpfs", "-o", "size=64k", "tmpfs")


def test_a_full_disk_is_an_oserror_and_leaves_no_part_of_a_file(full_disk: Path) -> None:
    with pytest.raises(OSError) as info:
        save_whole({"w": torch.zeros(256, 1024)}, full_disk / "steps.pt")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(full_disk / "steps.pt")
    assert h.listing(full_disk) == []


class _Engine:
    """What DeepSpeed's engine does in ``save_checkpoint``: torch.save into the folder."""

    def save_checkpoint(self, folder: str) -> None:
        torch.save({"w": torch.zeros(256, 1024)}, os.path.join(folder, "model_states.pt"))


def test_deepspeeds_save_on_a_full_disk_is_the_oserror_not_a_bug(full_disk: Path) -> None:
    with pytest.raises(RuntimeError, match=r"PytorchStreamWriter|inline_container"):
        _Engine().save_checkpoint(str(full_disk))  # torch's writer says so
    with pytest.raises(OSError) as info:
        _save_checkpoint(_Engine(), full_disk)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, RuntimeError)


def test_run_json_is_written_whole_too(full_disk: Path) -> None:
    # A run's record of itself: an empty run.json under its name would not parse.
    from ckpt_tools.harness.config import RUN_JSON, TrainResult

    result = TrainResult(
        strategy="single",
        model="mlp",
        world_size=1,
        devices=("cpu",),
        losses=(0.5,) * 4000,
        steps=4000,
        epoch=1,
    )
    (full_disk / "filler").write_bytes(b"\0" * (60 << 10))
    with pytest.raises(OSError) as info:
        result.write_json(full_disk)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(full_disk / RUN_JSON)
    assert h.listing(full_disk) == ["filler"]
    (full_disk / "filler").unlink()
    result.write_json(full_disk)
    assert TrainResult.read_json(full_disk) == result
