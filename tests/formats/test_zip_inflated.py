"""A deflated storage record (an archive re-zipped by a zip tool; torch reads it) is read
through an inflated copy: made once, holding the bytes torch inflates, removed with its
checkpoint, and never left half made."""

from __future__ import annotations

import gc
import tempfile
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the copies go to, watched by the tests."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _deflated(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    state = {"w": torch.arange(4096.0), "b": torch.ones(3, dtype=torch.int16)}
    plain, src = tmp_path / "plain.pt", tmp_path / "deflated.pt"
    torch.save(state, plain)
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    return src, torch.load(src, weights_only=True)


def test_a_copy_is_made_once_holds_what_torch_reads_and_goes_with_its_checkpoint(
    tmp_path: Path, scratch: Path
) -> None:
    src, want = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    assert list(scratch.iterdir()) == []  # opening inflates nothing to disk
    w = ckpt.root["w"]
    first, again = ckpt.span(w.storage), ckpt.span(w.storage)
    assert first == again and first.offset == 0 and first.nbytes == w.storage.nbytes
    assert Path(first.path).read_bytes() == want["w"].numpy().tobytes()
    assert len(list(scratch.rglob("*"))) == 2  # the folder and one copy
    del ckpt, w
    gc.collect()
    assert list(scratch.iterdir()) == []


def test_a_record_that_no_longer_inflates_is_refused_and_its_copy_removed(
    tmp_path: Path, scratch: Path
) -> None:
    src, _ = _deflated(tmp_path)
    ckpt = open_checkpoint(src)
    with open(src, "r+b") as f:  # changed after it was opened and checked
        f.truncate(200)
    with pytest.raises(CorruptCheckpointError, match="does not inflate"):
        ckpt.span(ckpt.root["w"].storage)
    assert [p for p in scratch.rglob("*") if p.is_file()] == []
