"""The fuzzer's forked ``ckpt`` (``fuzzkit.workers.CliServer``) answers as a fresh process.

Each case runs once as a fresh ``python -m MODULE`` (the oracle: the interpreter itself) and
once forked from the server, in folders that differ only in name: exit status, stdout, stderr
and the files written must be the same. Probe modules stand for what ``ckpt`` rarely does (an
uncaught exception, threads, ``atexit``, a signal); ``ckpt`` itself runs on real files.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzzkit.workers import CLI_MEMORY, CliResult, CliServer, child_env, limiter

from tests.helpers import fixture_path

PROBES = {
    "uncaught": "raise ValueError('probe failed')\n",
    "exit_text": "import sys\nsys.exit('leaving with a message')\n",
    "exit_code": "import sys\nprint('out', end='')\nsys.exit(3)\n",
    "streams": (
        "import os, sys\nprint(sys.argv[1:], os.getcwd(), repr(sys.stdin.read()))\n"
        "print('to stderr', file=sys.stderr, end='')\nprint(os.environ['CKPT_FUZZ_MARKER'][-6:])\n"
    ),
    "at_exit": (
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit ran')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread ended'))).start()\n"
    ),
    "signal": (
        "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    ),
    "path_first": "import sys, os\nprint(sys.path[0] == os.getcwd())\n",
}
CKPT_CASES = {
    "inspect": ["inspect", "dp.pt", "--json"],
    "refused": ["inspect", "truncated.pt"],
    "missing": ["inspect", "missing.pt"],
    "strip": ["strip-module", "dp.pt", "out/stripped.pt", "--json"],
    "convert": ["convert", "dp.pt", "out/converted.safetensors"],
    "usage": ["strip-module"],
    "version": ["--version"],
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    workdir = tmp_path_factory.mktemp("cli-server")
    cli = CliServer(workdir / "marker", workdir)
    cli.warm_up()
    yield cli
    cli.close()


def _fresh(module: str, args: list[str], cwd: Path, marker: Path) -> CliResult:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=cwd,
        env=child_env(marker),
        preexec_fn=limiter(CLI_MEMORY),
        timeout=60,
    )
    return CliResult(
        args,
        proc.returncode,
        proc.stdout.decode(),
        proc.stderr.decode(),
        time.monotonic() - start,
        False,
    )


def _folder(root: Path, name: str, probe: str | None = None) -> Path:
    folder = root / name
    (folder / "out").mkdir(parents=True)
    (folder / "dp.pt").write_bytes(fixture_path("dataparallel.pt").read_bytes())
    (folder / "truncated.pt").write_bytes(fixture_path("truncated.pt").read_bytes())
    if probe is not None:
        (folder / "probe.py").write_text(PROBES[probe])
    return folder


def _same(fresh: CliResult, forked: CliResult, fresh_dir: Path, forked_dir: Path) -> None:
    def plain(text: str, folder: Path) -> str:
        return text.replace(str(folder), "FOLDER")

    assert forked.returncode == fresh.returncode, (fresh, forked)
    assert plain(forked.stdout, forked_dir) == plain(fresh.stdout, fresh_dir)
    assert plain(forked.stderr, forked_dir) == plain(fresh.stderr, fresh_dir)
    written = {p.name: p.read_bytes() for p in (fresh_dir / "out").iterdir()}
    assert {p.name: p.read_bytes() for p in (forked_dir / "out").iterdir()} == written


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_forked_module_ends_as_the_interpreter_ends_it(
    server: CliServer, tmp_path: Path, probe: str
) -> None:
    fresh_dir, forked_dir = _folder(tmp_path, "a", probe), _folder(tmp_path, "b", probe)
    fresh = _fresh("probe", ["x", "y z"], fresh_dir, server.marker)
    forked = server.run(["x", "y z"], forked_dir, module="probe")
    _same(fresh, forked, fresh_dir, forked_dir)
    assert not forked.timed_out


@pytest.mark.parametrize("case", sorted(CKPT_CASES))
def test_a_forked_ckpt_answers_and_writes_as_a_fresh_one(
    server: CliServer, tmp_path: Path, case: str
) -> None:
    fresh_dir, forked_dir = _folder(tmp_path, "a"), _folder(tmp_path, "b")
    fresh = _fresh("ckpt_tools", CKPT_CASES[case], fresh_dir, server.marker)
    forked = server.run(CKPT_CASES[case], forked_dir)
    _same(fresh, forked, fresh_dir, forked_dir)


def test_a_command_past_its_time_is_killed_with_its_children(
    server: CliServer, tmp_path: Path
) -> None:
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "probe.py").write_text(
        "import subprocess, time\n"
        "child = subprocess.Popen(['sleep', '60'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    res = server.run([], folder, timeout=2, module="probe")
    assert res.timed_out and res.returncode == -signal.SIGKILL and res.seconds < 30
    pid = int((folder / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid), "the command's own child outlived the kill"
    after = server.run(["--version"], folder)  # the server goes on after a kill
    assert after.returncode == 0 and not after.timed_out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting for init to reap it
