"""torch asked in a child process: a script that prints one JSON line per file it is given.

A fresh process answers as a user's fresh ``import torch`` would: what this test process
imported (``torch._dynamo``, safe globals added by other tests) cannot change the answer.

Starting torch costs seconds, so one server per ``preload`` imports those modules once and
forks a child for every question: each answer comes from a process that has imported them
and nothing that an earlier question made it import or change.
"""

from __future__ import annotations

import atexit
import functools
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

# Reads one question per line, a JSON [script, paths]; a forked child runs the script on
# the paths, and the server then prints the end marker followed by the child's exit code.
_SERVER = r"""
import importlib, json, os, sys, traceback
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
for line in sys.stdin:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        script, paths = json.loads(line)
        sys.argv = ["-c", *paths]
        status = 0
        try:
            exec(compile(script, "<oracle>", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, waited = os.waitpid(pid, 0)
    print("\x1e" + str(os.waitstatus_to_exitcode(waited)), flush=True)
"""

_END = "\x1e"

_servers: dict[tuple[str, ...], tuple[subprocess.Popen[str], IO[bytes]]] = {}


def _server(preload: tuple[str, ...]) -> tuple[subprocess.Popen[str], IO[bytes]]:
    """The running server that imported ``preload``, started on first use."""
    found = _servers.get(preload)
    if found is not None and found[0].poll() is None:
        return found
    # Open as long as the server runs: read when a question fails.
    errors = tempfile.TemporaryFile()  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER, json.dumps(preload)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
    )
    _servers[preload] = (process, errors)
    return process, errors


def _stop_servers() -> None:
    for process, errors in _servers.values():
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        errors.close()
    _servers.clear()


atexit.register(_stop_servers)


def json_per_path(
    script: str, *paths: Path, preload: tuple[str, ...] = ("torch",), timeout: float = 300
) -> list[dict[str, Any]]:
    """Run ``script`` with ``paths`` as its arguments, in a process that has imported only
    ``preload``; the JSON line it printed for each path.

    Raises:
        subprocess.CalledProcessError: the script failed (its output and errors attached).
    """
    lines = run_script(script, *paths, preload=preload, timeout=timeout, check=True)
    return [json.loads(line) for line in lines[-len(paths) :]]


def run_script(
    script: str,
    *args: str | Path,
    preload: tuple[str, ...] = ("torch",),
    timeout: float = 300,
    check: bool = False,
) -> list[str]:
    """Run ``script`` with ``args`` as ``sys.argv[1:]`` in a process that has imported only
    ``preload``; the lines it printed. A script that fails is a failure only with ``check``
    (a loader refusing a file is an answer too).

    Raises:
        subprocess.CalledProcessError: with ``check``, the script failed.
    """
    process, errors = _server(preload)
    assert process.stdin is not None and process.stdout is not None
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    try:
        process.stdin.write(json.dumps([script, list(map(str, args))]) + "\n")
        process.stdin.flush()
        lines = []
        while not (line := process.stdout.readline()).startswith(_END) and line:
            lines.append(line)
    finally:
        watchdog.cancel()
    status = int(line[1:]) if line else -1
    if check and status != 0:
        errors.seek(0)
        raise subprocess.CalledProcessError(
            status, ["python", "-c", script], "".join(lines), errors.read().decode()
        )
    return lines


# The globals torch.load(weights_only=True) admits, as ``import torch`` leaves them and then
# as ``import torch._dynamo`` does (it adds some).
_TORCHS_ALLOWLISTS = """
import json, torch
from torch import _weights_only_unpickler as w
names = lambda: sorted({*w._get_allowed_globals(), *w._get_user_allowed_globals()})
fresh = names()
import torch._dynamo
print(json.dumps([fresh, names()]))
"""


@functools.cache
def torchs_allowlists() -> tuple[frozenset[str], frozenset[str]]:
    """torch's weights-only allowlist in a fresh process: after ``import torch``, and after
    ``import torch._dynamo`` too. This process's tests may have imported more of torch, and
    ``torch.distributed.tensor`` adds its own globals when imported."""
    fresh, dynamo = json.loads(run_script(_TORCHS_ALLOWLISTS, check=True)[-1])
    return frozenset(fresh), frozenset(dynamo)
