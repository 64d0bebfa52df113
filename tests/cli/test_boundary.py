"""The one boundary between the library and the shell: ``ckpt_tools.cli.boundary.guarded``.

A broken pipe ends every command with exit 1 (the console script's runs below hold that end
to end); the others hold what ``guarded`` does to stdout on the way out, for the stdouts a
caller may hand it: a real file (silenced, no descriptor left open), one already closed, and
none that is a file at all; and to stderr: silenced if its own pipe broke, else left alone.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.cli.boundary import guarded
from ckpt_tools.errors import UsageError
from ckpt_tools.io.interrupts import Interrupted
from tests.helpers import ckpt_env, console_script, fixture_path


def _pipe_breaks() -> None:
    raise BrokenPipeError(32, "Broken pipe")


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_broken_pipe_silences_a_real_stdout_and_leaks_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "stdout.txt"
    with target.open("w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        before = _open_descriptors()
        assert guarded(_pipe_breaks, "ckpt") == 1
        assert _open_descriptors() == before
        # What the interpreter flushes at exit now goes nowhere, and raises nothing.
        stdout.write("late output\n")
        stdout.flush()
    assert target.read_text() == ""


@pytest.mark.parametrize("kind", ["closed", "not a file", "none"])
def test_a_broken_pipe_ends_with_exit_1_whatever_stdout_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "closed":
        stdout: object = (tmp_path / "stdout.txt").open("w")
        stdout.close()  # type: ignore[attr-defined]
    else:
        stdout = io.StringIO() if kind == "not a file" else None
    monkeypatch.setattr(sys, "stdout", stdout)
    assert guarded(_pipe_breaks, "ckpt") == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_broken_pipe_silences_a_stderr_whose_pipe_broke(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read, write = os.pipe()
    os.close(read)
    with open(write, "w") as stderr:
        stderr.write("the error line the reader never got\n")  # held by the buffer
        monkeypatch.setattr(sys, "stdout", None)
        monkeypatch.setattr(sys, "stderr", stderr)
        before = _open_descriptors()
        assert guarded(_pipe_breaks, "ckpt") == 1
        assert _open_descriptors() == before
        # The interpreter's last flush offers what the pipe refused once more: it now goes
        # to /dev/null, where it used to fail and turn the exit code into 120.
        stderr.flush()


def test_a_broken_pipe_leaves_a_working_stderr_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "stderr.txt"
    with target.open("w") as stderr:
        monkeypatch.setattr(sys, "stdout", None)
        monkeypatch.setattr(sys, "stderr", stderr)
        assert guarded(_pipe_breaks, "ckpt") == 1
        stderr.write("said on the way out\n")
    assert target.read_text() == "said on the way out\n"


_STDOUT_CLOSED_UNDERNEATH = """
import os, sys
from ckpt_tools.cli.boundary import guarded

def pipe_breaks():
    raise BrokenPipeError(32, "Broken pipe")

os.close(1)  # sys.stdout still says fileno() == 1; /dev/null will be opened as 1
code = guarded(pipe_breaks, "ckpt")
print(code, os.path.exists("/proc/self/fd/1"), file=sys.stderr)
sys.stdout.write("late output\\n")
sys.stdout.flush()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_stdout_closed_underneath_is_silenced_not_closed_again() -> None:
    # /dev/null must not be opened as stdout's own number, then closed as a spare.
    done = subprocess.run(
        [sys.executable, "-c", _STDOUT_CLOSED_UNDERNEATH],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "1 True\n")


def test_an_error_becomes_one_line_and_its_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    def fails() -> None:
        raise UsageError("expected one input, found two")

    assert guarded(fails, "ckpt") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "ckpt: error: expected one input, found two\n"


@pytest.mark.parametrize("written", [None, "out.pt"])
def test_a_signal_says_whether_the_output_was_written(
    written: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted() -> None:
        raise Interrupted(signal.SIGTERM, written=written)

    assert guarded(interrupted, "ckpt") == 128 + signal.SIGTERM
    done = "nothing was written" if written is None else "'out.pt' had been written and is complete"
    assert capsys.readouterr().err == f"ckpt: interrupted by signal SIGTERM; {done}" + (
        " and the input is unchanged\n" if written is None else "\n"
    )


_DP = str(fixture_path("dataparallel.pt"))


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("src", [_DP, "missing.pt"], ids=["dataparallel.pt", "missing.pt"])
def test_a_broken_pipe_ends_the_console_script_with_exit_1(
    stream: str, src: str, tmp_path: Path
) -> None:
    # The reader of one stream is gone before anything is printed. What needed that stream
    # ends with exit 1: a success that cannot report (stdout), a failure that cannot say why
    # (stderr), which must never pass for a success (0).
    out = tmp_path / "out.pt"
    read, write = os.pipe()
    os.close(read)
    other = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: write}
    # Buffered, as a shell runs it: an unbuffered stderr keeps nothing of what a broken pipe
    # refused, so its last flush at exit could not fail whatever the boundary did.
    env = {k: v for k, v in ckpt_env().items() if k != "PYTHONUNBUFFERED"}
    try:
        run = subprocess.run(
            [console_script(), "strip-module", src, str(out)],
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
            **other,
        )
    finally:
        os.close(write)
    assert out.exists() == (src == _DP)
    expected = {("stdout", _DP): 1, ("stderr", _DP): 0, ("stderr", "missing.pt"): 1}
    assert run.returncode == expected.get((stream, src), 2)  # 2: the missing input, said


def test_with_ckpt_debug_the_error_comes_with_its_traceback(tmp_path: Path) -> None:
    run = subprocess.run(
        [console_script(), "strip-module", "missing.pt", "out.pt"],
        capture_output=True,
        text=True,
        env=ckpt_env(CKPT_DEBUG="1"),
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    # The traceback, then the line and the exit code a script relies on, as without it.
    assert run.returncode == 2
    assert "Traceback (most recent call last)" in run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-2].startswith("ckpt_tools.errors.CheckpointNotFoundError: ")
    assert lines[-1].startswith("ckpt: error: ") and "missing.pt" in lines[-1]


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (
            PermissionError(13, "Permission denied", "hf/model.safetensors"),
            2,
            "ckpt: error: Permission denied: 'hf/model.safetensors'\n",
        ),
        (
            OSError(28, "No space left on device"),
            6,
            "ckpt: error: writing failed (No space left on device)\n",
        ),
    ],
)
def test_another_error_of_the_system_is_one_line_too(
    error: OSError, code: int, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An input inside a folder that cannot be read, stdout on a full disk: not the library's
    # errors, still no traceback and no exit 1 (which means "differences found").
    def fails() -> None:
        raise error

    assert guarded(fails, "ckpt") == code
    assert capsys.readouterr().err == line


def _to_a_full_disk(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``ckpt ARGS`` with stdout on /dev/full (every write: ENOSPC)."""
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [console_script(), *args],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=ckpt_env(),
            cwd=cwd,
            timeout=120,
            check=False,
        )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--version"], ["inspect", _DP]])
def test_stdout_on_a_full_disk_is_one_line_and_exit_6(args: list[str], tmp_path: Path) -> None:
    run = _to_a_full_disk(args, tmp_path)
    assert run.returncode == 6
    assert run.stderr == "ckpt: error: writing failed (No space left on device)\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("json", [[], ["--json"]], ids=["text", "json"])
def test_a_summary_stdout_refuses_names_the_output_that_was_written(
    json: list[str], tmp_path: Path
) -> None:
    run = _to_a_full_disk(["strip-module", _DP, "out.pt", *json], tmp_path)
    assert run.returncode == 6
    assert run.stderr == (
        "ckpt: error: printing the summary to stdout failed (No space left on device); "
        "'out.pt' was written\n"
    )
    assert (tmp_path / "out.pt").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--bogus"], "No such option '--bogus'; see 'ckpt --help'"),
        (["strip-module"], "Missing argument 'SRC'; see 'ckpt strip-module --help'"),
        (["inspect", _DP, "--limit", "-3"], "'--limit': -3 is not in the range x>=0;"),
        (["average", _DP, _DP, "out.pt", "--last", "0"], "--last 0: expected a count of 1"),
        (["harness", "train", "--strategy", "single", "--lr", "-1"], "--lr -1.0: must be a"),
        (["harness", "train"], "Missing option '--strategy'. Choose from: single, dp, ddp,"),
        (["reshard", _DP, "out/"], "Missing option '--max-shard-size'; see 'ckpt reshard --help'"),
        (["slim", _DP, "o.pt", "--keep-dtype", "("], "--keep-dtype '(': not a valid regular expr"),
        (["average", _DP, _DP, "o.pt", "--weights", "1,x"], "'--weights': '1,x': expected"),
        (["average", "nomatch_*.pt", "o.pt"], "error: 'nomatch_*.pt' matches no file"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_option(
    args: list[str],
    line: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # click's own usage errors too: one line, as every other error, not four.
    from ckpt_tools.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ckpt: error: ") and line in err, err
