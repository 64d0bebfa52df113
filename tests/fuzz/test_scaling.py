"""Work that grows with the file, one dimension at a time: tensors, views of one storage,
keys, nesting depth, zip records.

Each scenario runs the real ``ckpt`` command (bounded in time and memory, as the fuzzer runs
it) on a file of size n and of size 8n, and holds the child's CPU time and peak memory to
linear growth: 8n may cost at most ``8 * SLACK`` times what n costs, where work that grows
with the square would cost 64 times. Hostile shapes past a limit must end in one line and
exit 5, never a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fuzzkit.budget import LONG
from fuzzkit.workers import CLI_MEMORY, child_env, limiter

# Growth allowed over linear: a loaded two-core machine, and start-up costs at small n.
SLACK = 2.5
SMALL, FACTOR = 1500, 8
TIMEOUT = 90.0
DEEP_PREFIX = "module." + ".".join(f"block{j}" for j in range(30))


@dataclass
class Measured:
    argv: list[str]
    returncode: int
    stderr: str
    cpu: float  # the child's user + system seconds
    peak_kib: int  # the child's peak resident memory


def _measured(args: Sequence[str], cwd: Path, timeout: float = TIMEOUT) -> Measured:
    """``python -m ckpt_tools ARGS``, memory-bounded, with its CPU time and peak RSS.

    The child is reaped with ``wait4`` for its own resource usage (``RUSAGE_CHILDREN`` would
    mix in every earlier child's peak).
    """
    argv = [sys.executable, "-m", "ckpt_tools", *args]
    with (cwd / "stderr").open("w+b") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=cwd,
            env=child_env(cwd / "marker"),
            preexec_fn=limiter(CLI_MEMORY),
        )
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    return Measured(
        list(args), proc.returncode, stderr, usage.ru_utime + usage.ru_stime, usage.ru_maxrss
    )


def _ok(res: Measured) -> None:
    assert res.returncode == 0, (res.argv, res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]


def _one_line_refusal(res: Measured) -> None:
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.returncode == 5, (res.argv, res.returncode, res.stderr[-2000:])
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr[-2000:]


def _grows_linearly(
    tmp_path: Path,
    build: Callable[[int, Path], Path],
    commands: Sequence[Callable[[Path, Path], list[str]]],
) -> None:
    """Each command on ``build(n)`` and ``build(8n)``: CPU and peak memory within linear."""
    runs: dict[int, list[Measured]] = {}
    for n in (SMALL, SMALL * FACTOR):
        folder = tmp_path / str(n)
        folder.mkdir()
        path = build(n, folder / "in.pt")
        runs[n] = []
        for i, command in enumerate(commands):
            res = _measured(command(path, folder / f"out{i}.pt"), folder)
            _ok(res)
            runs[n].append(res)
    bound = FACTOR * SLACK
    for small, large in zip(runs[SMALL], runs[SMALL * FACTOR]):
        what = f"{large.argv[0]}: {small.cpu:.2f} s -> {large.cpu:.2f} s"
        assert large.cpu < bound * max(small.cpu, 0.1), what
        memory = f"{large.argv[0]}: {small.peak_kib} KiB -> {large.peak_kib} KiB"
        assert large.peak_kib < bound * small.peak_kib, memory


def _inspect(path: Path, _: Path) -> list[str]:
    return ["inspect", str(path)]


def _scan(path: Path, _: Path) -> list[str]:
    return ["scan", str(path)]


def _inspect_group(path: Path, _: Path) -> list[str]:
    return ["inspect", "--group", str(path)]


def _strip(path: Path, out: Path) -> list[str]:
    return ["strip-module", str(path), str(out), "--no-fsync", "-q"]


def _strip_full(path: Path, out: Path) -> list[str]:
    return ["strip-module", str(path), str(out), "--no-fsync", "-q", "--verify", "full"]


def _rename(path: Path, out: Path) -> list[str]:
    return ["rename", str(path), str(out), "--sub", "module.=m.", "--no-fsync", "-q"]


def _distinct(n: int, path: Path) -> Path:
    torch.save({f"module.l{i}.weight": torch.zeros(1) for i in range(n)}, path)
    return path


def _views(n: int, path: Path) -> Path:
    base = torch.zeros(n)
    torch.save({f"module.t{i}": base[i : i + 1] for i in range(n)}, path)
    return path


def _long_keys(n: int, path: Path) -> Path:
    base = torch.zeros(n)
    torch.save({f"{DEEP_PREFIX}.{i}.weight": base[i : i + 1] for i in range(n)}, path)
    return path


def _nested(depth: int) -> Callable[[int, Path], Path]:
    def build(n: int, path: Path) -> Path:
        # Depth grows with n here: n // SMALL * depth levels (torch's pickler recurses).
        tree: dict[str, object] = {"w": torch.zeros(1)}
        for _ in range(depth * n // SMALL):
            tree = {"a": tree}
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            torch.save(tree, path)
        finally:
            sys.setrecursionlimit(limit)
        return path

    return build


def _extra_records(n: int, path: Path) -> Path:
    torch.save({"module.w": torch.zeros(2)}, path)
    with zipfile.ZipFile(path) as archive:
        root = archive.namelist()[0].split("/")[0]
    with zipfile.ZipFile(path, "a") as archive:
        for i in range(n):
            archive.writestr(f"{root}/extra/{i}", b"x")
    return path


def test_tensors_grow_linearly(tmp_path: Path) -> None:
    _grows_linearly(tmp_path, _distinct, [_inspect, _strip])


def test_views_of_one_storage_grow_linearly(tmp_path: Path) -> None:
    _grows_linearly(tmp_path, _views, [_inspect, _inspect_group, _strip_full, _scan])


def test_long_shared_key_prefixes_grow_linearly(tmp_path: Path) -> None:
    _grows_linearly(tmp_path, _long_keys, [_inspect_group, _rename])


def test_nesting_depth_grows_linearly(tmp_path: Path) -> None:
    # 20 levels at n, 160 at 8n: under the reader's limit of 200.
    _grows_linearly(tmp_path, _nested(20), [_inspect])


def test_zip_records_grow_linearly(tmp_path: Path) -> None:
    _grows_linearly(tmp_path, _extra_records, [_inspect, _strip, _scan])


def test_nesting_torch_reads_is_read_and_a_rewrite_past_its_limit_is_one_line(
    tmp_path: Path,
) -> None:
    # torch.load reads containers however deep; a rewrite pickles 300 levels at most.
    path = _nested(500)(SMALL, tmp_path / "deep.pt")
    read = _measured(["inspect", str(path)], tmp_path)
    assert read.returncode == 0 and "Traceback" not in read.stderr, read.stderr[-2000:]
    _one_line_refusal(_measured(_strip(path, tmp_path / "out.pt"), tmp_path))
    assert not (tmp_path / "out.pt").exists()


def test_a_wrapper_stack_past_the_limit_is_one_line(tmp_path: Path) -> None:
    # One key among many peeled layer by layer: each layer a pass over every key.
    sd = {f"l{i}.weight": torch.zeros(1) for i in range(SMALL)}
    sd["_orig_mod." * 5000 + "w"] = torch.zeros(1)  # torch.compile's may prefix some keys
    path = tmp_path / "stacked.pt"
    torch.save(sd, path)
    for args in (["inspect", str(path)], _strip(path, tmp_path / "out.pt")):
        _one_line_refusal(_measured(args, tmp_path))
    assert not (tmp_path / "out.pt").exists()


# The whole 200,000 in the long fuzz run (make fuzz); a quarter of it in make test, whose
# time is bounded (growth itself is held to linear above).
MANY_VIEWS = 200_000 if LONG else 50_000


@pytest.fixture(scope="module")
def many_views(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _views(MANY_VIEWS, tmp_path_factory.mktemp("views") / "views.pt")


@pytest.mark.parametrize(
    "command",
    [
        lambda path, out: ["inspect", "--limit", "20", str(path)],
        lambda path, out: [*_strip(path, out), "--verify", "none"],
        _scan,
    ],
    ids=["inspect", "strip-module", "scan"],
)
def test_many_views_of_one_storage_finish_or_refuse_in_one_line(
    many_views: Path, tmp_path: Path, command: Callable[[Path, Path], list[str]]
) -> None:
    res = _measured(command(many_views, tmp_path / "out.pt"), tmp_path)
    if res.returncode == 5:
        _one_line_refusal(res)
    else:
        _ok(res)
    assert res.peak_kib < 1 << 20, f"{res.argv[0]} peaked at {res.peak_kib} KiB"
