"""Sandboxed helper processes and the ``ckpt`` command, each with a timeout and a memory bound.

Everything that reads a fuzzed file runs in a child process with ``RLIMIT_AS`` set in a
``preexec_fn`` (Linux ignores ``RLIMIT_RSS``; the address-space limit is what bounds memory),
and is killed when it runs past its time. The test process never parses a fuzzed input.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLI_MEMORY = int(1.5 * (1 << 30))  # what a ckpt command may map: 1.5 GiB
ORACLE_MEMORY = 4 << 30  # torch itself maps ~1 GiB of address space
CLI_TIMEOUT = 30.0  # seconds; the inputs are a few KB, anything near this is a hang
# The reference readers' bound: torch answers a few-KB input well within a second, three
# times over under a loaded suite; past this it is stuck (a pickle whose keys hash
# exponentially) and the input is judged without it, so waiting longer buys no verdict.
ORACLE_TIMEOUT = 6.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
FILE_SIZE = 256 << 20  # no file a command writes may grow past this (SIGXFSZ kills it)


def limiter(address_space: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE, FILE_SIZE))
        os.setsid()  # its own process group, so a kill reaches its children too
        # Killed with its parent: a worker busy on a hostile input (torch on a memo bomb
        # never finishes) outlived a killed test run, spinning at full CPU for hours.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return apply


def child_env(marker: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPT_DEBUG", "PYTHONWARNINGS")}
    env["CKPT_FUZZ_MARKER"] = str(marker)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _kill_group(pid: int) -> None:
    """SIGKILL to the process group a limited child leads (``setsid``), gone or not."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _kill(proc: subprocess.Popen[Any]) -> None:
    _kill_group(proc.pid)
    proc.wait()


class Worker:
    """A long-lived script answering one JSON line per JSON request line.

    A request that runs past ``timeout`` kills the worker (it is restarted on the next call)
    and answers ``{"timeout": true}``; a worker that dies answers ``{"died": returncode}``.
    """

    def __init__(self, script: str, memory: int, marker: Path, cwd: Path) -> None:
        self.script, self.memory, self.marker, self.cwd = script, memory, marker, cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending = b""  # what the worker wrote past its last answer read
        self.calls = 0

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.pending = b""
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / self.script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=self.cwd,
                env=child_env(self.marker),
                preexec_fn=limiter(self.memory),
            )
        return self.proc

    def warm_up(self) -> None:
        self._start()

    def call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = self._start()
        assert proc.stdin is not None
        self.calls += 1
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        return self._answer(timeout, kill=True)

    def call_pending(self, timeout: float) -> dict[str, Any]:
        """The next answer to the request already sent; ``{"timeout": true}`` past
        ``timeout``, the worker left running (it still owes that answer)."""
        return self._answer(timeout, kill=False)

    def _answer(self, timeout: float, kill: bool) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        deadline = time.monotonic() + timeout
        # Read the pipe itself: a buffered readline could take a second answer along, which
        # the selector would then never report.
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    if kill:
                        _kill(proc)
                        self.proc = None
                    return {"timeout": True}
                if sel.select(left):
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        return self._died()
                    self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def _died(self) -> dict[str, Any]:
        assert self.proc is not None
        _kill(self.proc)
        code = self.proc.returncode
        self.proc = None
        return {"died": code}

    def close(self) -> None:
        if self.proc is not None:
            _kill(self.proc)
            self.proc = None


class CliServer:
    """``ckpt ARGS`` in a process of its own, forked from a server that has imported the
    command line (``cli_server.py``): a fresh ``python -m ckpt_tools`` from the fork on,
    without paying Python's start-up for each of the fuzzer's many small inputs. Memory and
    file size are bounded as :func:`run_ckpt` bounds them; a command past its time is killed
    with its process group. A server that dies fails the call, never the verdict silently.
    """

    def __init__(self, marker: Path, workdir: Path) -> None:
        self.marker = marker
        self.io = workdir / "cli-io"
        self.io.mkdir(parents=True, exist_ok=True)
        self.server = Worker("cli_server.py", CLI_MEMORY, marker, workdir)

    def warm_up(self) -> None:
        self.server.warm_up()

    def close(self) -> None:
        self.server.close()

    def run(
        self,
        args: Sequence[str],
        cwd: Path,
        timeout: float = CLI_TIMEOUT,
        module: str = "ckpt_tools",
    ) -> CliResult:
        """``python -m MODULE ARGS`` in ``cwd`` (``module`` is for this class's own tests)."""
        out, err = self.io / "stdout", self.io / "stderr"
        request = {"argv": list(args), "cwd": str(cwd), "env": child_env(self.marker)}
        request |= {"stdout": str(out), "stderr": str(err), "module": module}
        start = time.monotonic()
        started = self.server.call(request, timeout=CLI_TIMEOUT)
        assert "pid" in started, f"the ckpt server did not start {list(args)}: {started}"
        ended = self.server.call_pending(timeout=max(timeout - (time.monotonic() - start), 0))
        timed_out = "timeout" in ended
        if timed_out:
            _kill_group(started["pid"])
            ended = self.server.call_pending(timeout=CLI_TIMEOUT)
        assert "status" in ended, f"the ckpt server lost {list(args)}: {ended}"
        return CliResult(
            list(args),
            os.waitstatus_to_exitcode(ended["status"]),
            out.read_bytes().decode("utf-8", "replace"),
            err.read_bytes().decode("utf-8", "replace"),
            time.monotonic() - start,
            timed_out,
        )


@dataclass
class CliResult:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool


def run_ckpt(
    args: Sequence[str],
    cwd: Path,
    marker: Path,
    timeout: float = CLI_TIMEOUT,
    memory: int = CLI_MEMORY,
) -> CliResult:
    """``python -m ckpt_tools ARGS`` in ``cwd``: a real process, time- and memory-bounded."""
    argv = [sys.executable, "-m", "ckpt_tools", *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=child_env(marker),
        preexec_fn=limiter(memory),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        timed_out = True
    return CliResult(
        list(args),
        proc.returncode,
        out.decode("utf-8", "replace"),
        err.decode("utf-8", "replace"),
        time.monotonic() - start,
        timed_out,
    )
