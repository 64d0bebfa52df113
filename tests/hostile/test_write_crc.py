"""A rewrite refuses a damaged input up front instead of failing after writing.

A rewrite copies records as they are, CRC included, and the default verification checks the
CRC-32 of every small record; a record whose bytes do not match its CRC (the layout-preserving
copy would carry it over unchanged) is refused before anything is written (exit 4).
"""

from __future__ import annotations

import subprocess
import zipfile
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


@pytest.mark.parametrize("how", ["compute_crc32=False", "skip_data"])
def test_a_file_torch_saved_without_crcs_is_read_and_rewritten(tmp_path: Path, how: str) -> None:
    # torch writes 0 for every CRC when told not to compute them (and under skip_data, whose
    # storages it never fills); its reader checks none, so a 0 is no damage.
    import torch.utils.serialization.config as serialization

    from ckpt_tools import load_state_dict, scan

    src = tmp_path / "in.pt"
    state = {"module.w": torch.arange(8.0), "module.b": torch.ones(2)}
    if how == "skip_data":
        with torch.serialization.skip_data():
            torch.save(state, src)
    else:
        serialization.save.compute_crc32 = False
        try:
            torch.save(state, src)
        finally:
            serialization.save.compute_crc32 = True
    records = open_checkpoint(src).records
    assert {r.crc32 for name, r in records.items() if name.startswith("data/")} == {0}
    want = torch.load(src, weights_only=True)
    got = load_state_dict(src)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert scan(src).files[0].verdict == "clean"
    strip_module(src, tmp_path / "out.pt", verify="full")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(out[k.removeprefix("module.")], v) for k, v in want.items())
    # The output's CRCs are computed: an archive every zip tool reads.
    with zipfile.ZipFile(tmp_path / "out.pt") as archive:
        assert archive.testzip() is None
