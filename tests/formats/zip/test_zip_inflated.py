"""A deflated storage record (an archive re-zipped by a zip tool; torch reads it) is read
through an inflated copy: made once per process, holding the bytes torch inflates, living as
long as the process (without a name where /proc/self/fd reads it), never left half made, and
refused by name where the temporary directory has no room."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from ckpt_tools import add_module, convert, extract, slim
from ckpt_tools.errors import CorruptCheckpointError, ResourceLimitError
from ckpt_tools.formats import open_checkpoint
from tests.helpers.files import deflated_copy, read_span


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the copies go to, watched by the tests."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _deflated(tmp_path: Path, fill: float = 1.0) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {"w": torch.full((4096,), fill), "b": torch.ones(3, dtype=torch.int16)}
    torch.save(state, tmp_path / "plain.pt")
    src = deflated_copy(tmp_path / "plain.pt", tmp_path / "deflated.pt")
    return src, torch.load(src, weights_only=True)


def test_a_copy_is_made_once_holds_what_torch_reads_and_outlives_its_checkpoint(
    tmp_path: Path, scratch: Path
) -> None:
    src, want = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    w = ckpt.root["w"]
    first = ckpt.span(w.storage)
    assert first.offset == 0 and first.nbytes == w.storage.nbytes
    # Once per process, however often the file is opened; a span outlives its checkpoint
    # (a DeepSpeed folder's rank files are let go before the output is written).
    del ckpt, w
    gc.collect()
    again = open_checkpoint(src)
    assert again.span(again.root["w"].storage) == first
    assert read_span(again, again.root["w"].storage) == want["w"].numpy().tobytes()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="copies are named without /proc")
def test_a_copy_has_no_name_so_no_ending_of_the_process_leaves_it(
    tmp_path: Path, scratch: Path
) -> None:
    src, _ = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    span = ckpt.span(ckpt.root["b"].storage)
    assert span.path.startswith("/proc/self/fd/") and list(scratch.iterdir()) == []


def test_a_record_that_no_longer_inflates_is_refused_and_leaves_nothing(
    tmp_path: Path, scratch: Path
) -> None:
    src, _ = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    with open(src, "r+b") as f:  # changed after it was opened and checked
        f.truncate(200)
    with pytest.raises(CorruptCheckpointError, match="does not inflate"):
        ckpt.span(ckpt.root["w"].storage)
    assert list(scratch.rglob("*")) == []


def test_a_temporary_directory_without_room_is_named(
    tmp_path: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, _ = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    room = shutil.disk_usage(scratch)._replace(free=100)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: room)
    with pytest.raises(ResourceLimitError, match="set TMPDIR to a folder with room") as err:
        ckpt.span(ckpt.root["w"].storage)
    assert str(scratch) in str(err.value) and "16.0 KiB" in str(err.value)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_an_archives_records_share_one_copy_file(tmp_path: Path, scratch: Path) -> None:
    # A model's thousands of tensors must not hold thousands of descriptors (ulimit -n).
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(300)}
    torch.save(state, tmp_path / "plain.pt")
    ckpt = open_checkpoint(deflated_copy(tmp_path / "plain.pt", tmp_path / "many.pt"))
    before = len(os.listdir("/proc/self/fd"))
    spans = {key: ckpt.span(t.storage) for key, t in ckpt.root.items()}
    assert len(os.listdir("/proc/self/fd")) <= before + 1
    assert len({span.path for span in spans.values()}) == 1
    for key, t in ckpt.root.items():
        assert read_span(ckpt, t.storage) == state[key].numpy().tobytes(), key


def test_a_file_rewritten_in_place_with_its_size_and_times_is_inflated_anew(
    tmp_path: Path, scratch: Path
) -> None:
    # cp -p or rsync --inplace -t keep the inode, the size and the modification time.
    src, _ = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    first = ckpt.span(ckpt.root["w"].storage)
    kept = src.stat()
    other = tmp_path / "other"
    other.mkdir()
    replaced, want = _deflated(other, fill=-1.0)  # deflates to as many bytes as 1.0
    assert replaced.stat().st_size == kept.st_size
    with open(src, "r+b") as f:
        f.write(replaced.read_bytes())
    os.utime(src, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    again = open_checkpoint(src)
    assert again.span(again.root["w"].storage) != first
    assert read_span(again, again.root["w"].storage) == want["w"].numpy().tobytes()


def test_a_dry_run_inflates_nothing(
    tmp_path: Path, scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The records were checked to inflate to their size when the file was opened; planning
    # the write must not copy them again (a dry run needs no room in TMPDIR).
    src, _ = _deflated(tmp_path)
    room = shutil.disk_usage(scratch)._replace(free=0)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: room)
    out = tmp_path / "out.safetensors"
    assert add_module(src, out, dry_run=True).dry_run
    folder = tmp_path / "folder"
    assert convert(
        src, folder, output_format="safetensors", max_shard_size=8192, dry_run=True
    ).dry_run
    assert slim(src, out, dtype="bf16", dry_run=True).dry_run
    assert extract(src, out, prefix="w", dry_run=True).dry_run
    assert not out.exists() and not folder.exists()
    with pytest.raises(ResourceLimitError, match="set TMPDIR"):  # the real run needs it
        add_module(src, out)
