"""A ``ckpt`` killed with SIGKILL mid-write leaves nothing.

Real ``ckpt`` processes are paused (``PAUSE_ENV``, read only for tests) once their output is
written and verified but not yet named, then killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpt_tools.io.atomic import PAUSE_ENV, atomic_output
from ckpt_tools.io.temp_names import remove_stale_temps
from tests.helpers import has_file_open_in, listing

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _kill_while_writing(command: list[str], folder: Path) -> None:
    """Run ``command`` paused before its rename, SIGKILL it once it writes in ``folder``."""
    env = {**os.environ, PAUSE_ENV: "60"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not has_file_open_in(proc.pid, folder.resolve()):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the writer never opened its temp file"
            time.sleep(0.01)
        time.sleep(0.2)  # well inside the pause: written, verified, not yet named
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def src(tmp_path) -> Path:
    path = tmp_path / "in" / "ddp.pt"
    path.parent.mkdir()
    torch.save({"module.w": torch.arange(1000.0), "module.b": torch.ones(3)}, path)
    return path


def _has_unnamed_files(folder: Path) -> bool:
    try:
        os.close(os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600))
    except (OSError, AttributeError):
        return False
    return True


@pytest.mark.parametrize(
    ("args", "name"), [(("strip-module",), "out.pt"), (("convert",), "out.safetensors")]
)
def test_sigkill_mid_write_leaves_nothing(args, name, src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    if not _has_unnamed_files(out):
        pytest.skip("this file system has no O_TMPFILE: the named fallback is tested below")
    before = src.read_bytes()
    _kill_while_writing([CKPT, *args, str(src), str(out / name)], out)
    assert listing(out) == []  # the unnamed temp file died with the process
    assert src.read_bytes() == before


_NAMED_WRITER = """
import sys
from ckpt_tools.io.atomic import atomic_output
with atomic_output(sys.argv[1], unnamed=False) as out:
    out.file.write(b"x" * 100_000)
"""


def test_named_fallback_temp_is_removed_by_the_next_run(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _kill_while_writing([sys.executable, "-c", _NAMED_WRITER, str(out / "a.bin")], out)
    (stale,) = listing(out)  # the fallback's named temp survives a SIGKILL ...
    assert stale.startswith(".a.bin.ckpt-tmp-")
    result = subprocess.run(
        [CKPT, "strip-module", str(src), str(out / "plain.pt")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert listing(out) == ["plain.pt"]  # ... and the next run in that folder removes it
    assert list(torch.load(out / "plain.pt", weights_only=True, mmap=True)) == ["w", "b"]


def test_stale_temps_of_live_processes_are_kept(tmp_path):
    mine = tmp_path / f".x.pt.ckpt-tmp-{os.getpid()}-0abc"
    mine.write_bytes(b"in progress")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    theirs = tmp_path / f".y.pt.ckpt-tmp-{dead.pid}-0abc"
    theirs.write_bytes(b"left by a killed run")
    assert remove_stale_temps(tmp_path) == [theirs]
    assert listing(tmp_path) == [mine.name]


def test_a_temp_named_with_a_pid_no_process_can_have_is_stale(tmp_path):
    # No process can own it (os.kill cannot even be asked about it): removed, file or folder.
    odd = tmp_path / f".x.pt.ckpt-tmp-{'9' * 30}-0abc"
    odd.write_bytes(b"x")
    assert remove_stale_temps(tmp_path) == [odd]
    (tmp_path / f".out.ckpt-tmpdir-{'9' * 30}-0abc").mkdir()
    torch.save({"w": torch.zeros(2)}, tmp_path / "in.pt")
    result = subprocess.run(
        [CKPT, "convert", str(tmp_path / "in.pt"), f"{tmp_path / 'out'}/"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert listing(tmp_path) == ["in.pt", "out"]


def test_unnamed_temp_is_invisible_while_writing(tmp_path):
    if not _has_unnamed_files(tmp_path):
        pytest.skip("this file system has no O_TMPFILE")
    with atomic_output(tmp_path / "t.bin") as out:
        out.file.write(b"data")
        out.file.flush()
        assert listing(tmp_path) == []  # nothing named until it is complete
        assert out.path.read_bytes() == b"data"  # yet it can be re-read to verify it
    assert listing(tmp_path) == ["t.bin"] and (tmp_path / "t.bin").read_bytes() == b"data"


def test_a_stale_temp_that_cannot_be_removed_does_not_stop_the_write(tmp_path):
    # Another user's temp in a shared sticky folder cannot be unlinked (EPERM); a folder
    # under a temp file's name cannot either (EISDIR): the write goes on beside it.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stuck = tmp_path / f".y.pt.ckpt-tmp-{dead.pid}-0abc"
    stuck.mkdir()
    torch.save({"module.w": torch.zeros(2)}, tmp_path / "in.pt")
    result = subprocess.run(
        [CKPT, "strip-module", str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == ["w"]
    assert stuck.is_dir()
