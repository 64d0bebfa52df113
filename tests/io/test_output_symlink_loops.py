"""Output paths that cannot be written, or that change under the write: an output that is,
or passes through, a symlink loop is refused in one line (exit 6) that names it, never a
traceback; an output folder another writer publishes first is refused as one that already
exists. Inputs are made with ``torch.save``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import OutputExistsError
from ckpt_tools.io.atomic import AtomicFile
from ckpt_tools.io.writers.hf_folder import FolderFile, write_folder
from tests.helpers.cli import run_ckpt


@pytest.fixture
def loops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with ``dp.pt``, a file link to itself and a folder link to itself."""
    monkeypatch.chdir(tmp_path)
    torch.save({"module.w": torch.ones(2)}, "dp.pt")
    Path("loop.pt").symlink_to("loop.pt")
    Path("ldir").symlink_to("ldir")
    return tmp_path


@pytest.mark.parametrize(
    "args",
    [
        ("strip-module", "dp.pt", "loop.pt"),
        ("strip-module", "dp.pt", "loop.pt", "--force"),
        ("convert", "dp.pt", "loop.pt"),
        ("add-module", "dp.pt", "ldir/o.pt"),
        ("convert", "dp.pt", "ldir/hf/"),
        ("convert", "dp.pt", "ldir", "--max-shard-size", "1KB"),
    ],
)
def test_a_symlink_loop_is_refused_in_one_line(loops: Path, args: tuple[str, ...]) -> None:
    before = sorted(p.name for p in loops.iterdir())
    result = run_ckpt(*args, code=6, how="module", cwd=loops)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"output {args[2]!r}" in lines[0] and "symlink loop" in lines[0]
    assert ".ckpt-tmp" not in lines[0]
    assert sorted(p.name for p in loops.iterdir()) == before
    assert Path("loop.pt").is_symlink() and Path("ldir").is_symlink()


def test_a_folder_published_meanwhile_already_exists(tmp_path: Path) -> None:
    """Another writer names the output folder while this one writes: this one is refused
    as the up-front check refuses an existing folder, and leaves the other's files."""
    target = tmp_path / "hf"

    def fill(out: AtomicFile) -> None:
        target.mkdir()  # the other writer's folder, published first
        (target / "model.safetensors").write_bytes(b"theirs")
        out.file.write(b"ours")

    with pytest.raises(OutputExistsError) as caught:
        write_folder(target, [FolderFile("notes.txt", fill, lambda path: "")])
    assert "already exists" in str(caught.value) and "force" in str(caught.value)
    assert "Directory not empty" not in str(caught.value)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"theirs"
    assert not [p for p in tmp_path.iterdir() if ".ckpt-tmp" in p.name]
