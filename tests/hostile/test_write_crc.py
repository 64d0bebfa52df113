"""A rewrite refuses a damaged input up front instead of failing after writing.

A rewrite copies records as they are, CRC included, and the default verification checks the
CRC-32 of every small record; a record whose bytes do not match its CRC (the layout-preserving
copy would carry it over unchanged) is refused before anything is written (exit 4).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import EXIT_CORRUPT, CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.ops.rewrite.conversion import convert
from ckpt_tools.ops.rewrite.rewriting import strip_module
from tests.helpers import console_script


def _damaged(tmp_path: Path) -> Path:
    path = tmp_path / "in.pt"
    torch.save({"module.w": torch.arange(8.0), "module.b": torch.ones(2)}, path)
    record = open_checkpoint(path).records["data/0"]
    data = bytearray(path.read_bytes())
    data[record.data_offset] ^= 0xFF  # the bytes change, the CRC does not
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("rewrite", [strip_module, convert])
def test_a_record_failing_its_crc_is_refused_before_writing(tmp_path: Path, rewrite) -> None:
    src = _damaged(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"'data/0' fails its CRC-32 check"):
        rewrite(src, tmp_path / "out.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_the_command_exits_4_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    src = _damaged(tmp_path)
    run = subprocess.run(
        [console_script(), "strip-module", str(src), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == EXIT_CORRUPT and run.stderr.count("\n") == 1, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]
