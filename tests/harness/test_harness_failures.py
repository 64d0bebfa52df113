"""A failed or killed rank of a multi-process run is one line with a fitting exit code."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckpt_tools.cli.main import main
from ckpt_tools.harness import TrainConfig, ddp, train
from ckpt_tools.harness.failures import (
    PeerLostError,
    RankFailedError,
    port_taken,
    rank_failure,
    write_failure,
)

ENTRY = [sys.executable, "-m", "ckpt_tools.harness", "train"]
PROG = "python -m ckpt_tools.harness"


def _children(pid: int) -> list[tuple[int, bytes]]:
    """The child processes of ``pid`` and their command lines."""
    found = Path(f"/proc/{pid}/task/{pid}/children")
    pids = [int(p) for p in found.read_text().split()] if found.exists() else []
    return [(p, Path(f"/proc/{p}/cmdline").read_bytes()) for p in pids]


def _rank_pids(parent: int, count: int, timeout: float) -> list[int]:
    """The ranks started by ``parent``, once all started: its ``spawn`` children, or the
    children of its ``forkserver`` (which forks them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = []
        for pid, cmdline in _children(parent):
            if b"spawn_main" in cmdline:
                ranks.append(pid)
            elif b"forkserver" in cmdline:
                ranks += [rank for rank, _ in _children(pid)]
        if len(ranks) == count:
            return sorted(ranks)
        time.sleep(0.2)
    raise AssertionError(f"the {count} ranks of {parent} did not start")


def test_a_rank_that_cannot_write_is_one_line_with_its_exit_code(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "afile").write_bytes(b"")
    out = tmp_path / "afile" / "sub"
    args = ["--strategy", "ddp", "--steps", "1", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(
        [*ENTRY, *args], env=subprocess_env, capture_output=True, text=True, timeout=120
    )
    # As --strategy manual reports it (exit 2, one line), with the rank named.
    assert proc.stderr == f"{PROG}: error: rank 0 of 2 failed: Not a directory: {str(out)!r}\n"
    assert proc.returncode == 2


def test_a_failed_dcp_save_of_fsdp_is_one_line_with_the_rank_s_error(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # torch's CheckpointException is a BaseException gathering the ranks' errors.
    (tmp_path / "dcp").write_bytes(b"")  # where the DCP folder goes
    args = ["--strategy", "fsdp", "--steps", "1", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*ENTRY, *args], env=subprocess_env, capture_output=True, text=True, timeout=120
    )
    dcp = str(tmp_path / "dcp")
    assert proc.stderr == f"{PROG}: error: rank 0 of 2 failed: File exists: {dcp!r}\n"
    assert proc.returncode == 2


def test_a_rank_that_cannot_join_the_others_is_one_line_not_a_traceback(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # The machine's set-up (gloo told to use an interface that does not exist), not a bug.
    env = {**subprocess_env, "GLOO_SOCKET_IFNAME": "no-such-interface"}
    args = ["--strategy", "ddp", "--steps", "1", "--device", "cpu", "--out", str(tmp_path)]
    proc = subprocess.run([*ENTRY, *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"{PROG}: error: rank ")
    assert "could not join the other ranks over gloo" in proc.stderr
    assert "no-such-interface" in proc.stderr
    assert proc.returncode == 2


@pytest.mark.parametrize("closed", [">&-", "2>&-"])
def test_the_entry_exits_with_its_status_with_a_stream_closed(
    closed: str, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # It flushes both streams itself before leaving with os._exit.
    args = ["--strategy", "single", "--steps", "1", "--device", "cpu", "--out", str(tmp_path)]
    shell = ["sh", "-c", f'exec "$@" {closed}', "sh", *ENTRY, *args]
    proc = subprocess.run(shell, env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bare.pt").is_file()


@pytest.mark.parametrize("torchrun", [True, False])
def test_ckpt_as_a_torchrun_rank_leaves_without_the_interpreters_exit(
    torchrun: bool, subprocess_env: dict[str, str]
) -> None:
    # `torchrun --no-python ckpt harness train`: gloo's threads can abort that exit.
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('interpreter exit ran', file=sys.stderr))\n"
        "from ckpt_tools.cli.main import run\n"
        "sys.argv = ['ckpt', 'harness', 'train', '--strategy', 'single', '--device', 'cpu']\n"
        "run()\n"
    )
    env = dict(subprocess_env)
    if torchrun:
        env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    if torchrun:  # refused before it joins a group: its line, its status, nothing after
        assert proc.returncode == 2
        assert proc.stderr.startswith("ckpt: error: --strategy 'single': runs in one process")
        assert proc.stderr.count("\n") == 1
    else:
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "interpreter exit ran\n"


def _raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as e:  # with its traceback, as a rank has it
        return e


def test_a_port_taken_before_rank_0_bound_it_is_told_by_its_summary_too(tmp_path: Path) -> None:
    # The launcher sees "terminated with signal SIGABRT" where rank 0's exit aborted after
    # it wrote its summary; the summary still says why, and the run is retried.
    aborted = RuntimeError("process 0 terminated with signal SIGABRT")
    assert not port_taken(tmp_path, aborted)
    listen = RuntimeError("The server socket has failed to listen ... address already in use")
    write_failure(tmp_path, 0, _raised(listen))
    assert port_taken(tmp_path, aborted)


def test_a_spawned_run_whose_port_is_taken_is_retried_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = [ddp.free_port(), held.getsockname()[1]]
        monkeypatch.setattr(ddp, "free_port", ports.pop)  # the held port first
        config = TrainConfig(strategy="ddp", world_size=2, steps=1, device="cpu")
        assert train(config).world_size == 2
    assert ports == []


def test_a_port_taken_on_every_try_is_one_line_not_a_rank_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        tries = []
        monkeypatch.setattr(ddp, "free_port", lambda: tries.append(1) or held.getsockname()[1])
        args = ["harness", "train", "--strategy", "ddp", "--world-size", "2", "--steps", "1"]
        assert main([*args, "--device", "cpu", "--out", str(tmp_path / "run")]) == 5
    assert len(tries) == 3
    err = capsys.readouterr().err
    assert err.startswith("ckpt: error: the ranks could not meet: another process took")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_rank_that_said_why_it_failed_is_told_by_that_whatever_its_exit(tmp_path: Path) -> None:
    # The interpreter's exit can abort (SIGABRT) after the rank wrote its summary.
    write_failure(tmp_path, 0, _raised(ValueError("a bug of the harness")))
    bug = rank_failure(tmp_path, 2, [-signal.SIGABRT, -signal.SIGTERM], 0, "DDP")
    assert type(bug) is RuntimeError and "ValueError: a bug of the harness" in str(bug)
    peers = tmp_path / "peers"
    peers.mkdir()
    write_failure(peers, 1, PeerLostError(1, 2, RuntimeError("Connection closed by peer")))
    peer = rank_failure(peers, 2, [1, -signal.SIGABRT], 1, "DDP")
    assert isinstance(peer, RankFailedError) and "lost the other ranks" in str(peer)
    # A rank that wrote nothing is still told by its signal.
    killed = rank_failure(peers, 2, [-signal.SIGKILL, -signal.SIGABRT], 1, "DDP")
    assert isinstance(killed, RankFailedError) and killed.signal_name == "SIGKILL"
    # Killed after rank 1 stopped (the launcher's SIGKILL of a rank that did not end on its
    # SIGTERM, a stopped one): said with what rank 1 said.
    assert "after rank 1 stopped: lost the other ranks" in str(killed)


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A TMPDIR of its own for a child, by a short path: the forkserver's socket lies in it,
    and a socket's path is limited to 107 bytes (a worker's tmp_path can be longer)."""
    import shutil
    import tempfile

    made = Path(tempfile.mkdtemp(prefix="ckh-"))
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _sigint_default() -> None:
    """A child's Ctrl-C at its default, as a user's shell starts a command: a test worker
    may ignore SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks in /proc")
# SIGINT: torch's spawn wrapper swallows a rank's KeyboardInterrupt (it exits 0), and the
# launcher then blamed another rank, or a run.json never written.
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_rank_killed_by_a_signal_is_one_line_naming_it(
    sig: int, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    args = ["--strategy", "ddp", "--steps", "100000", "--device", "cpu", "--out", str(tmp_path)]
    with subprocess.Popen(
        [*ENTRY, *args],
        env=subprocess_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_default,
    ) as proc:
        try:
            rank1 = _rank_pids(proc.pid, 2, timeout=60)[1]
            time.sleep(1)  # into training: the ranks have joined their process group
            os.kill(rank1, sig)
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
    name = signal.Signals(sig).name
    assert err == f"{PROG}: error: rank 1 of 2 was killed by signal {name} ({int(sig)})\n"
    assert proc.returncode == 128 + sig and out == ""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks in /proc")
@pytest.mark.parametrize(
    ("sig", "entry"),
    [
        (signal.SIGTERM, ENTRY),
        (signal.SIGKILL, ENTRY),
        (signal.SIGINT, ENTRY),
        # ckpt leaves through the interpreter, which waits for child processes at its exit.
        (signal.SIGINT, [sys.executable, "-m", "ckpt_tools", "harness", "train"]),
    ],
    ids=["SIGTERM", "SIGKILL", "SIGINT", "SIGINT-ckpt"],
)
def test_ranks_end_with_a_launcher_killed_alone(
    sig: int,
    entry: list[str],
    tmp_path: Path,
    short_tmpdir: Path,
    subprocess_env: dict[str, str],
) -> None:
    # Not the process group (Ctrl-C, timeout): the launcher alone, as `kill PID` does.
    out, scratch = tmp_path / "run", short_tmpdir
    args = ["--strategy", "ddp", "--steps", "100000", "--device", "cpu", "--out", str(out)]
    env = {**subprocess_env, "TMPDIR": str(scratch)}

    with subprocess.Popen(
        [*entry, *args], env=env, stderr=subprocess.PIPE, preexec_fn=_sigint_default
    ) as proc:
        try:
            ranks = _rank_pids(proc.pid, 2, timeout=60)
            time.sleep(1)
            os.kill(proc.pid, sig)
            proc.wait(timeout=60)
            deadline = time.monotonic() + 30
            while any(Path(f"/proc/{r}").exists() for r in ranks) and time.monotonic() < deadline:
                time.sleep(0.2)
            alive = [r for r in ranks if Path(f"/proc/{r}/status").exists()]
            zombies = [r for r in alive if "(zombie)" in Path(f"/proc/{r}/status").read_text()]
        finally:
            proc.kill()
    assert alive == zombies, "ranks outlived their launcher"
    assert not any(out.glob("*.pt"))
    if sig != signal.SIGKILL:  # (nothing cleans up after SIGKILL) the scratch folder is gone
        assert not list(scratch.glob("ckpt-harness-*")), list(scratch.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks in /proc")
def test_parity_killed_by_sigterm_leaves_no_scratch_tree(
    short_tmpdir: Path, subprocess_env: dict[str, str]
) -> None:
    # `kill PID`, `timeout`, a cancelled CI job: the checkpoints parity trains into go too.
    scratch = short_tmpdir
    command = [sys.executable, "-m", "ckpt_tools", "harness", "parity", "--arch", "lenet"]
    command += ["--steps", "100000", "--strategies", "single,ddp"]
    env = {**subprocess_env, "TMPDIR": str(scratch)}
    with subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, preexec_fn=_sigint_default
    ) as proc:
        try:
            deadline = time.monotonic() + 60
            while not list(scratch.glob("ckpt-harness-parity-*/single")):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode != 0
    assert not list(scratch.glob("ckpt-harness-*")), list(scratch.iterdir())


@pytest.mark.slow
def test_under_torchrun_the_rank_left_waiting_says_so_in_one_line(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    (tmp_path / "afile").write_bytes(b"")
    out = tmp_path / "afile" / "sub"
    # A slow monitor: torchrun ends the other rank only after it has said its line.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--monitor-interval", "3"]
    command = [*launcher, "--nproc-per-node", "2", "-m", "ckpt_tools.harness", "train"]
    args = ["--strategy", "ddp", "--steps", "1", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(
        [*command, *args], env=subprocess_env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    # Rank 0's own error, and rank 1, whose barrier broke, in a line of its own.
    assert f"{PROG}: error: Not a directory: {str(out)!r}" in lines
    lost = [line for line in lines if "rank 1 of 2 failed: lost the other ranks" in line]
    # gloo's words for a peer that went away: closed, or reset where data was still unread.
    assert len(lost) == 1 and re.search(r"Connection (closed|reset) by peer", lost[0]), proc.stderr
    # Rank 0 left with its own status, not a signal from an interpreter exit that aborted.
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr
    # torchrun's own report follows, with torchrun's traceback; none of the ranks'.
    assert "ckpt_tools/harness/" not in proc.stderr and "ckpt_tools/cli/" not in proc.stderr


def test_a_write_that_fails_is_one_line_exit_6_and_leaves_no_part(
    tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    # A file size limit stands in for a full disk: the write fails with EFBIG, which torch's
    # own file writer would turn into a RuntimeError and a truncated file.
    import resource

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))

    out = tmp_path / "run"
    args = ["--strategy", "single", "--steps", "1", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(
        [*ENTRY, *args],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limited,
    )
    assert proc.returncode == 6, proc.stderr
    assert proc.stderr.startswith(f"{PROG}: error: ") and proc.stderr.count("\n") == 1
    assert "File too large" in proc.stderr and ".pt" in proc.stderr
    assert not [p for p in out.rglob("*") if p.suffix == ".pt" or p.name.startswith(".")]
