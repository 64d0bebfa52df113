"""``sanitize`` keeps only the zip records ``torch.save`` writes.

torch.load never reads a record it has no use for, so a pickle added beside ``data.pkl``
loads without a word; but a scanner, or another loader, reads it. The inputs are real
``torch.save`` files with a record added by ``zipfile``; the payloads name ``builtins.print``,
harmless if anything ran them. The oracles are ``zipfile`` (what the output holds),
``ct.scan`` and ``torch.load(weights_only=True)`` against the saved tensors.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import UnsafeContentError

# A protocol 2 pickle that calls builtins.print, and the same as protocol 0 text (UTF-8,
# which the reader accepts as a serialization id).
PAYLOAD = b"\x80\x02cbuiltins\nprint\nX\x06\x00\x00\x00markerq\x00\x85q\x01Rq\x02."
TEXT_PAYLOAD = b"cbuiltins\nprint\n(Vmarker\ntR."


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    path = tmp_path / "in.pt"
    torch.save(tensors, path)
    return path, tensors


def _assert_plain(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    assert ct.scan(out).verdict == "clean"
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value)


def test_a_record_torch_save_never_writes_is_dropped_and_listed(tmp_path: Path) -> None:
    src, tensors = _saved(tmp_path)
    with zipfile.ZipFile(src, "a") as z:
        z.writestr("in/foo.pkl", PAYLOAD)
    assert ct.scan(src).verdict != "clean"
    out = tmp_path / "out.pt"

    result = ct.sanitize(src, out)

    assert "in/foo.pkl" not in zipfile.ZipFile(out).namelist()
    assert result.dropped == ("in/foo.pkl",)
    assert [c.became for c in result.dropped_values] == ["dropped"]
    assert "in/foo.pkl" in str(result)
    _assert_plain(out, tensors)


def test_a_storage_record_no_tensor_names_is_dropped_and_listed(tmp_path: Path) -> None:
    src, tensors = _saved(tmp_path)
    with zipfile.ZipFile(src, "a") as z:
        z.writestr("in/data/7", PAYLOAD)
    out = tmp_path / "out.pt"

    result = ct.sanitize(src, out)

    assert "in/data/7" not in zipfile.ZipFile(out).namelist()
    assert result.dropped == ("in/data/7",)
    _assert_plain(out, tensors)


def test_a_serialization_id_that_is_no_number_is_dropped(tmp_path: Path) -> None:
    src, tensors = _saved(tmp_path)
    rebuilt = tmp_path / "rebuilt.pt"
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(rebuilt, "w") as new:
        for info in old.infolist():
            is_id = info.filename.endswith("/.data/serialization_id")
            new.writestr(info.filename, TEXT_PAYLOAD if is_id else old.read(info))
    assert ct.scan(rebuilt).verdict != "clean"
    out = tmp_path / "out.pt"

    result = ct.sanitize(rebuilt, out)

    assert result.dropped == ("in/.data/serialization_id",)  # the root torch.save named
    _assert_plain(out, tensors)


def test_torch_saves_own_records_are_all_kept(tmp_path: Path) -> None:
    src, tensors = _saved(tmp_path)
    out = tmp_path / "out.pt"

    result = ct.sanitize(src, out)

    assert result.dropped == ()
    assert zipfile.ZipFile(out).namelist() == zipfile.ZipFile(src).namelist()
    _assert_plain(out, tensors)


def test_strict_refuses_a_record_torch_save_never_writes(tmp_path: Path) -> None:
    src, _ = _saved(tmp_path)
    with zipfile.ZipFile(src, "a") as z:
        z.writestr("in/foo.pkl", PAYLOAD)
    out = tmp_path / "out.pt"

    with pytest.raises(UnsafeContentError, match=re.escape("in/foo.pkl")):
        ct.sanitize(src, out, refuse_unsafe=True)
    assert not out.exists()
