"""A Hugging Face cache blob is never replaced through a snapshot's link: the cache names each
blob by the hash of its bytes and links every snapshot holding that file to it, so a rewrite
there (in place, or with force over the link) would change every snapshot at once. The cache
is laid out as huggingface_hub lays it out (``models--org--name/{blobs,snapshots}``); a link
to a file elsewhere is still followed and its target replaced.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import OutputError


@pytest.fixture
def cached(tmp_path: Path) -> tuple[Path, Path]:
    """Two snapshots linking one blob (a DataParallel state dict), as the hub cache does."""
    repo = tmp_path / "hub" / "models--org--net"
    blob = repo / "blobs" / "4f2a"  # (a real one is the sha256 of the bytes)
    blob.parent.mkdir(parents=True)
    torch.save({"module.fc.weight": torch.arange(6.0).reshape(2, 3)}, blob)
    links = []
    for rev in ("a1", "b2"):
        link = repo / "snapshots" / rev / "pytorch_model.bin"
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        links.append(link)
    return blob, links[0]


def test_a_rewrite_through_a_snapshot_link_is_refused(cached: tuple[Path, Path]) -> None:
    blob, link = cached
    before = blob.read_bytes()
    other = blob.parents[3] / "other.pt"
    torch.save({"fc.weight": torch.zeros(2, 3)}, other)
    for call in (
        lambda: ct.strip_module(link, link, in_place=True),
        lambda: ct.strip_module(link, link, in_place=True, dry_run=True),
        lambda: ct.convert(other, link, force=True),
    ):
        with pytest.raises(OutputError, match="links to the Hugging Face cache blob") as info:
            call()
        assert "another path" in str(info.value)
    assert blob.read_bytes() == before and link.is_symlink()


def test_the_same_rewrite_to_another_path_reads_the_cached_file(
    cached: tuple[Path, Path], tmp_path: Path
) -> None:
    blob, link = cached
    ct.strip_module(link, tmp_path / "plain.pt")
    got = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert list(got) == ["fc.weight"]
    assert torch.equal(got["fc.weight"], torch.load(blob, weights_only=True)["module.fc.weight"])


def test_a_link_to_a_file_outside_a_cache_is_still_followed(tmp_path: Path) -> None:
    real, link = tmp_path / "runs" / "blobs" / "last.pt", tmp_path / "last.pt"
    real.parent.mkdir(parents=True)
    torch.save({"module.w": torch.ones(2)}, real)
    link.symlink_to(real)
    ct.strip_module(link, link, in_place=True)
    assert link.is_symlink() and list(torch.load(real, weights_only=True)) == ["w"]
