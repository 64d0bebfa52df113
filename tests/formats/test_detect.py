"""detect_format: paths taken as given, and reading a file without importing pathlib."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tools
from ckpt_tools.errors import CheckpointNotFoundError, UnsupportedFormatError
from ckpt_tools.formats import detect_format, open_checkpoint
from tests.helpers import fixture_path

# A process without site (so without the development venv's editable finder, which imports
# pathlib itself): what opening and describing a file imports, as a regular install has it.
_OPENS = """
import sys
sys.path.insert(0, sys.argv[1])
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.ops.inspect.inspection import inspect_checkpoint
inspect_checkpoint(open_checkpoint(sys.argv[2]))
print("pathlib" in sys.modules)
"""


@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_reading_a_file_never_imports_pathlib(name: str) -> None:
    # pathlib (with fnmatch, ntpath and urllib.parse) is one of the larger imports of a
    # command's start; reading a checkpoint needs nothing of it.
    root = str(Path(ckpt_tools.__file__).resolve().parent.parent)
    run = subprocess.run(
        [sys.executable, "-S", "-c", _OPENS, root, str(fixture_path(name))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False"]


def test_a_missing_path_is_named_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointNotFoundError) as caught:
        detect_format("./nothing.pt")
    assert caught.value.path == "./nothing.pt"
    assert "'./nothing.pt'" in str(caught.value)
    assert repr(os.getcwd()) in str(caught.value)


def test_a_path_given_as_text_or_path_reads_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = fixture_path("model.pt")
    monkeypatch.chdir(source.parent)
    assert detect_format(source.name) == detect_format(Path(source.name)) == "torch-zip"
    assert sorted(open_checkpoint(source.name).root) == sorted(open_checkpoint(source).root)
    pickled = tmp_path / "numbers.pt"
    pickled.write_bytes(fixture_path("numbers_p0.pkl").read_bytes())
    # A protocol-0 pickle is read as one under a .pt name, not under other names.
    assert detect_format(pickled) == "pickle"
    assert detect_format(str(pickled)) == "pickle"
    renamed = pickled.rename(tmp_path / "numbers.txt")
    with pytest.raises(UnsupportedFormatError):
        detect_format(renamed)
