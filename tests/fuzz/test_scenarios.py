"""The finding classes a byte mutation cannot reach: non-regular files (5), index.json paths
that leave the folder (6), and a SIGKILL during a rewrite (9).

Each scenario runs the real ``ckpt`` command, bounded in time and memory, and checks the same
promises as the fuzzer. A scenario listed in ``EXPECTED_FAILURES.json`` as ``scenario:<name>``
is a known open bug and is ``xfail(strict=True)``.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fuzzkit.checks import DOCUMENTED_EXIT_CODES
from fuzzkit.registry import expected
from fuzzkit.workers import CLI_MEMORY, child_env, limiter, run_ckpt

from tests.helpers.files import has_file_open_in

EXPECTED = expected()
REFUSED = {2, 3, 4, 5}


def _scenario(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    entry = EXPECTED.get(f"scenario:{name}")
    if entry is None:
        return lambda f: f
    reason = f"finding class {entry['class']}: {entry['what']}"
    return pytest.mark.xfail(strict=True, reason=reason)


def _safetensors(path: Path, nbytes: int = 16, sparse: bool = False) -> Path:
    header = json.dumps({"w": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}})
    header += " " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        if sparse:
            f.truncate(f.tell() + nbytes)
        else:
            f.write(bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    return path


def _one_line_refusal(res: object, allowed: set[int]) -> None:
    assert not res.timed_out, f"{res.argv} blocked for {res.seconds:.1f} s"  # type: ignore[attr-defined]
    assert "Traceback" not in res.stderr, res.stderr  # type: ignore[attr-defined]
    assert res.returncode in allowed, (res.returncode, res.stderr)  # type: ignore[attr-defined]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # type: ignore[attr-defined]


@_scenario("fifo-inspect")
def test_fifo_input_is_refused_not_read(tmp_path: Path) -> None:
    """Class 5: a FIFO named as the checkpoint is refused at once (opening it would block)."""
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    res = run_ckpt(["inspect", str(fifo)], tmp_path, tmp_path / "marker", timeout=6)
    _one_line_refusal(res, REFUSED)


@_scenario("fifo-convert")
def test_fifo_input_to_a_rewrite_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    res = run_ckpt(["convert", str(fifo), str(out)], tmp_path, tmp_path / "marker", timeout=6)
    _one_line_refusal(res, REFUSED)
    assert not list(out.parent.iterdir())


def test_fifo_as_output_does_not_block(tmp_path: Path) -> None:
    """Class 5: OUT is a FIFO: refused (exit 6), or replaced by the file with --force."""
    src = _safetensors(tmp_path / "in.safetensors")
    out = tmp_path / "out.pt"
    os.mkfifo(out)
    res = run_ckpt(
        ["convert", str(src), str(out), "--force"], tmp_path, tmp_path / "marker", timeout=10
    )
    assert not res.timed_out and "Traceback" not in res.stderr, res.stderr
    assert res.returncode in (0, 6), (res.returncode, res.stderr)
    assert out.is_fifo() if res.returncode else out.is_file()


def _index_folder(tmp_path: Path, target: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    index = {"metadata": {"total_size": 16}, "weight_map": {"w": target}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def _escape(target: str, via: str, key: str) -> object:
    entry = EXPECTED.get(f"scenario:index-escape-{key}")
    marks = []
    if entry is not None:
        reason = f"finding class {entry['class']}: {entry['what']}"
        marks = [pytest.mark.xfail(strict=True, reason=reason)]
    return pytest.param(target, via, marks=marks, id=f"{via}-{key}")


@pytest.mark.parametrize(
    ("target", "via"),
    [
        _escape(target, via, key)
        for target, key in (
            ("../outside.safetensors", "dotdot"),
            ("ABS", "abs"),
            ("sub/../../outside.safetensors", "sub-dotdot"),
        )
        for via in ("folder", "index")
    ],
)
def test_index_shard_paths_stay_in_the_folder(tmp_path: Path, target: str, via: str) -> None:
    """Class 6: an index.json whose shard path leaves its folder is refused, never read."""
    outside = _safetensors(tmp_path / "outside.safetensors")
    target = str(outside) if target == "ABS" else target
    folder = _index_folder(tmp_path, target)
    arg = folder if via == "folder" else folder / "model.safetensors.index.json"
    res = run_ckpt(["inspect", str(arg)], tmp_path, tmp_path / "marker", timeout=20)
    _one_line_refusal(res, REFUSED)


@_scenario("sigkill-temp")
def test_sigkill_during_a_rewrite_leaves_nothing(tmp_path: Path) -> None:
    """Class 9: SIGKILL while the output is being written leaves no temp file behind."""
    src = _safetensors(tmp_path / "big.safetensors", 96 << 20, sparse=True)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = [sys.executable, "-m", "ckpt_tools", "convert", str(src), str(out_dir / "big.pt")]
    proc = subprocess.Popen(
        [*argv, "--verify", "full"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
        env=child_env(tmp_path / "marker"),
        preexec_fn=limiter(CLI_MEMORY),
    )
    deadline = time.monotonic() + 60
    killed = False
    while proc.poll() is None and time.monotonic() < deadline:
        if has_file_open_in(proc.pid, out_dir):
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
            break
        time.sleep(0.001)
    if not killed:
        proc.kill()
    proc.wait()
    if not killed:
        pytest.skip("the rewrite finished before it could be killed mid-write")
    assert not list(out_dir.iterdir()), sorted(p.name for p in out_dir.iterdir())


def test_exit_codes_are_documented() -> None:
    assert {0, 2, 3, 4, 5, 6, 7} == DOCUMENTED_EXIT_CODES
