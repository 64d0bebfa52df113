"""Shared helpers for the benchmark scripts (not part of the package, not run by the tests).

What is here:

* generating synthetic checkpoints: :func:`make_checkpoints` writes a ``.pt`` (``torch.save``
  of a dict of float32 tensors with DataParallel keys ``module.layers.{i}.{...}.weight``) and
  the same tensors as ``.safetensors``;
* measuring a command run as a subprocess: :func:`measure` (wall time and peak RSS),
  :func:`synced_run` (a command that writes an output, with the output's fsync timed),
  :func:`interleaved_rounds` and :func:`median_runs`;
* the page cache: :func:`drop_caches` (works only as root, outside most containers' limits)
  and :func:`cache_state_note`;
* formatting: :func:`fmt_table`, :func:`ratio`, :func:`verdict`.

Wall time is always measured in this process with ``time.perf_counter`` around the child's
whole life (fork, exec, interpreter start, exit). Peak RSS comes from GNU ``/usr/bin/time
-f "%e %M"`` when it is installed, else from ``os.wait4``'s ``ru_maxrss`` (KiB on Linux).
(``/usr/bin/time``'s own ``%e`` has 10 ms resolution, too coarse for sub-second commands,
so it is recorded but not used as the wall time.)

Import torch only inside the functions that need it: ``bench_diff.py`` and others may import
this module just for :func:`measure`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CKPT",
    "MIB",
    "PYTHON",
    "REPO",
    "SYNCED_HEADERS",
    "GeneratedPair",
    "Measurement",
    "Summary",
    "cache_state_note",
    "checkpoint_shapes",
    "ckpt_command",
    "ckpt_json",
    "drop_caches",
    "fmt_table",
    "installed_copy",
    "interleaved_rounds",
    "load_note",
    "machine_note",
    "make_checkpoints",
    "measure",
    "median_runs",
    "python_command",
    "ratio",
    "rotated_order",
    "rss_method",
    "save_pt",
    "save_safetensors",
    "sync_all",
    "sync_file",
    "sync_folder",
    "synced_cells",
    "synced_run",
    "use_ckpt",
    "verdict",
    "workdir",
]

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# The installed console script of the same environment; `python -m ckpt_tools` otherwise.
_CKPT_SCRIPT = Path(sys.executable).parent / "ckpt"
CKPT: list[str] = (
    [str(_CKPT_SCRIPT)] if _CKPT_SCRIPT.exists() else [sys.executable, "-m", "ckpt_tools"]
)
GNU_TIME = "/usr/bin/time"
MIB = 1 << 20


# --------------------------------------------------------------------------- checkpoints


# One transformer-like layer: (suffix, shape as a function of the width d). 7 tensors,
# 12*d*d + d elements. Square attention projections, rectangular MLP, a 1-D norm weight.
_LAYER: tuple[tuple[str, Callable[[int], tuple[int, ...]]], ...] = (
    ("attn.q_proj.weight", lambda d: (d, d)),
    ("attn.k_proj.weight", lambda d: (d, d)),
    ("attn.v_proj.weight", lambda d: (d, d)),
    ("attn.o_proj.weight", lambda d: (d, d)),
    ("mlp.fc1.weight", lambda d: (4 * d, d)),
    ("mlp.fc2.weight", lambda d: (d, 4 * d)),
    ("norm.weight", lambda d: (d,)),
)


def checkpoint_shapes(
    size_bytes: int, n_tensors: int = 350, prefix: str = "module."
) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of ``n_tensors`` float32 tensors totalling about ``size_bytes``.

    Keys are DataParallel-wrapped: ``module.layers.{i}.attn.q_proj.weight`` ... 7 tensors a
    layer; when ``n_tensors`` is not a multiple of 7 the last layer is partial. The width d
    is chosen so the total is within a fraction of a percent of ``size_bytes`` (exact up to
    the rounding of d; shapes are never zero).
    """
    if n_tensors < 1:
        raise ValueError("n_tensors must be >= 1")
    full, rest = divmod(n_tensors, len(_LAYER))
    layers = [list(_LAYER)] * full + ([list(_LAYER[:rest])] if rest else [])

    def elements(d: int) -> int:
        return sum(math.prod(shape(d)) for layer in layers for _, shape in layer)

    # Solve elements(d) ~= size/4 by bisection (elements is increasing in d).
    target = max(size_bytes // 4, 1)
    lo, hi = 1, 1
    while elements(hi) < target:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if elements(mid) < target:
            lo = mid + 1
        else:
            hi = mid
    d = lo if lo == 1 or abs(elements(lo) - target) <= abs(elements(lo - 1) - target) else lo - 1
    out = []
    for i, layer in enumerate(layers):
        for suffix, shape in layer:
            out.append((f"{prefix}layers.{i}.{suffix}", shape(d)))
    return out


def _tensors(shapes: Sequence[tuple[str, tuple[int, ...]]], seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    # Random bytes (not zeros) so nothing downstream can take a sparse-file shortcut.
    return {name: torch.rand(shape, generator=g, dtype=torch.float32) for name, shape in shapes}


def save_pt(path: str | os.PathLike[str], sd: dict) -> None:
    """``torch.save`` and fsync, so the file's writeback is not charged to the benchmark."""
    import torch

    torch.save(sd, os.fspath(path))
    sync_file(path)


def save_safetensors(path: str | os.PathLike[str], sd: dict) -> None:
    """``safetensors.torch.save_file`` (with ``format: pt`` metadata) and fsync."""
    from safetensors.torch import save_file

    save_file(sd, os.fspath(path), metadata={"format": "pt"})
    sync_file(path)


@dataclass(frozen=True)
class GeneratedPair:
    """A generated ``.pt`` and ``.safetensors`` holding the same tensors."""

    pt: Path
    safetensors: Path
    n_tensors: int
    nbytes: int  # tensor bytes (the file sizes are a little larger)

    @property
    def label(self) -> str:
        return f"{self.n_tensors} tensors, {self.nbytes / MIB:.0f} MiB"


def make_checkpoints(
    folder: str | os.PathLike[str],
    size_mb: float,
    n_tensors: int = 350,
    stem: str | None = None,
    formats: Sequence[str] = ("pt", "safetensors"),
    seed: int = 0,
) -> GeneratedPair:
    """Write ``STEM.pt`` and/or ``STEM.safetensors`` of about ``size_mb`` MiB in ``folder``.

    The tensors are built once and written in both formats, then freed. Both files are
    fsynced so later timings do not pay for this writeback.
    """
    shapes = checkpoint_shapes(int(size_mb * MIB), n_tensors)
    stem = stem or f"ckpt_{n_tensors}t_{int(size_mb)}mb"
    folder = Path(folder)
    sd = _tensors(shapes, seed)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    pt, st = folder / f"{stem}.pt", folder / f"{stem}.safetensors"
    if "pt" in formats:
        save_pt(pt, sd)
    if "safetensors" in formats:
        save_safetensors(st, sd)
    del sd
    return GeneratedPair(pt, st, len(shapes), nbytes)


@contextlib.contextmanager
def workdir(parent: str | os.PathLike[str] | None = None, keep: bool = False) -> Iterator[Path]:
    """A fresh temp folder (under ``parent``, default ``/tmp``), removed at the end.

    Put it on the same file system as the checkpoints you care about: ``copy_file_range``
    and rename behave differently across file systems.
    """
    parent = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=parent))
    try:
        yield path
    finally:
        if keep:
            print(f"(kept {path})", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measurement:
    """One subprocess run."""

    wall_s: float
    peak_rss_kb: int
    returncode: int
    extra_s: float = 0.0  # time spent after the command (e.g. fsync of its output), timed
    cpu_s: float = 0.0  # user + system CPU time of the command and its children

    @property
    def total_s(self) -> float:
        return self.wall_s + self.extra_s

    @property
    def peak_rss_mb(self) -> float:
        return self.peak_rss_kb / 1024


_WAIT4_HELPER = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    f.write(f"{os.waitstatus_to_exitcode(status)} {wall:.6f} {usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""


def rss_method() -> str:
    """``"/usr/bin/time"`` when GNU time is installed, else ``"os.wait4"``."""
    return "/usr/bin/time" if os.access(GNU_TIME, os.X_OK) else "os.wait4"


def measure(
    cmd: Sequence[str],
    *,
    stdout: int | None = subprocess.DEVNULL,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    check: bool = True,
    method: str | None = None,
) -> Measurement:
    """Run ``cmd`` and return its wall time (seconds) and peak RSS (KiB).

    Args:
        cmd: the command; not run through a shell (so no shell process is measured).
        stdout: where its stdout goes (default ``/dev/null``, as ``> /dev/null``).
        method: ``"/usr/bin/time"`` or ``"os.wait4"`` for the RSS; default :func:`rss_method`.
        check: raise ``RuntimeError`` (with the command's stderr) when it fails.
    """
    method = method or rss_method()
    cmd = [os.fspath(c) for c in cmd]
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as report:
        if method == "/usr/bin/time":
            full = [GNU_TIME, "-f", "%e %M", "-o", report.name, *cmd]
        else:
            # Not os.wait4 on a direct child: Linux carries a process's RSS high-water mark
            # across fork and exec, so a child of this (possibly torch-sized) process would
            # report this process's peak. A small helper forks the command, wait4s it and
            # writes its ru_maxrss (the helper's own ~10 MB is then the floor).
            full = [sys.executable, "-S", "-c", _WAIT4_HELPER, report.name, *cmd]
        start = time.perf_counter()
        proc = subprocess.Popen(full, stdout=stdout, stderr=err, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)  # usage: only if no report was written
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        # Linux's wait4 reports the child's CPU time with that of the children it waited for
        # (the command under /usr/bin/time or the fork helper): less disturbed by other load
        # than the wall time, which waits for a CPU whenever the machine is busy.
        cpu = usage.ru_utime + usage.ru_stime
        # GNU time writes "Command exited with non-zero status N" first on failure; the
        # helper writes "STATUS MAXRSS". Either way the last line ends with the KiB.
        last = report.read().strip().splitlines()[-1:]
        try:
            rss_kb = int(last[0].split()[-1])
        except (IndexError, ValueError):
            rss_kb = usage.ru_maxrss
        if method != "/usr/bin/time":
            # The helper's own start-up is not the command's: use the wall time it measured.
            with contextlib.suppress(IndexError, ValueError):
                wall = float(last[0].split()[1])
        if check and proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(
                f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                + err.read().decode(errors="replace")[-4000:]
            )
    return Measurement(wall, rss_kb, proc.returncode, cpu_s=cpu)


def sync_file(path: str | os.PathLike[str]) -> float:
    """fsync one file (its data and metadata); returns the seconds it took."""
    start = time.perf_counter()
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def sync_all() -> None:
    """``sync``: flush every dirty page of every file system (not timed by callers)."""
    os.sync()


def sync_folder(folder: str | os.PathLike[str]) -> float:
    """fsync every file of ``folder``; returns the seconds it took."""
    start = time.perf_counter()
    for path in Path(folder).iterdir():
        sync_file(path)
    return time.perf_counter() - start


def synced_run(cmd: Sequence[str], out: Path, *, remove: bool = True) -> Measurement:
    """Run ``cmd`` (which writes ``out``, a file or a folder), fsync ``out`` (timed).

    The fsync is the run's ``extra_s``: a command that returns before its bytes are on disk
    would otherwise look faster than one that waits for them. With ``remove`` (the default)
    ``out`` is then deleted and everything ``sync``-ed (untimed), so the next run starts clean.
    """
    m = measure(cmd)
    extra = sync_folder(out) if out.is_dir() else sync_file(out)
    if remove:
        if out.is_dir():
            shutil.rmtree(out)
        else:
            out.unlink()
        sync_all()
    return Measurement(m.wall_s, m.peak_rss_kb, m.returncode, extra_s=extra, cpu_s=m.cpu_s)


# The columns of a command run with synced_run: its own time, the fsync after it, the sum.
SYNCED_HEADERS = ["cmd s", "+fsync s", "total s", "min-max total"]


def synced_cells(s: Summary) -> list[str]:
    """The :data:`SYNCED_HEADERS` cells of commands run with :func:`synced_run`."""
    return [f"{s.wall_s:.3f}", f"{s.extra_s:.3f}", f"{s.total_s:.3f}", s.spread]


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. True when the kernel accepted it.

    Needs root and a writable ``/proc/sys`` (many containers refuse it). Dropping the cache
    also evicts Python's and torch's own files, so cold runs include reading them.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cache_state_note(cold: bool, dropped_ok: bool | None) -> str:
    """One line saying whether the timings are warm- or cold-cache."""
    if not cold:
        return (
            "page cache: WARM (inputs and Python/torch files were read by a warm-up run and "
            "stay cached; caches are not dropped)"
        )
    if dropped_ok:
        return (
            "page cache: COLD (sync; echo 3 > /proc/sys/vm/drop_caches before every run: "
            "the checkpoint AND the interpreter/torch files are read from disk)"
        )
    return "page cache: requested COLD but drop_caches was refused -> runs are WARM"


@dataclass
class Summary:
    """Median over repeats of one measured thing."""

    label: str
    runs: list[Measurement] = field(default_factory=list)

    def add(self, m: Measurement) -> None:
        self.runs.append(m)

    @property
    def wall_s(self) -> float:
        return statistics.median(m.wall_s for m in self.runs)

    @property
    def total_s(self) -> float:
        return statistics.median(m.total_s for m in self.runs)

    @property
    def extra_s(self) -> float:
        return statistics.median(m.extra_s for m in self.runs)

    @property
    def cpu_s(self) -> float:
        return statistics.median(m.cpu_s for m in self.runs)

    @property
    def peak_rss_mb(self) -> float:
        # The worst run: a target on peak memory is about the maximum, not the typical.
        return max(m.peak_rss_kb for m in self.runs) / 1024

    @property
    def best_s(self) -> float:
        """The fastest run: what the command costs when nothing else gets in its way."""
        return min(m.total_s for m in self.runs)

    @property
    def spread(self) -> str:
        walls = sorted(m.total_s for m in self.runs)
        return f"{walls[0]:.3f}-{walls[-1]:.3f}"


def rotated_order(names: Sequence[str], i: int) -> list[str]:
    """Round ``i``'s order: one name further along each round, every other block reversed.

    Round ``i`` starts at ``names[i % n]``; the rounds of every other block of ``n`` rounds
    take the names in reverse order. On a VM's disk a large write that follows the deletion
    of another output, or a page-cache copy that follows a direct write (which frees no page
    cache for it), can take several times as long as the same command one place later
    (benchmarks/README.md); with ``n`` names, ``2n`` rounds give each one every place and
    every predecessor equally often.

    Example:
        >>> [rotated_order("abc", i) for i in range(4)]
        [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b'], ['c', 'b', 'a']]
    """
    order = list(names) if (i // len(names)) % 2 == 0 else list(names)[::-1]
    start = i % len(names)
    return order[start:] + order[:start]


def interleaved_rounds(
    commands: dict[str, Sequence[str]],
    repeats: int,
    run: Callable[[Sequence[str]], Measurement] = measure,
    *,
    warmup: int = 1,
    before: Callable[[], None] | None = None,
    rotate: bool = False,
) -> dict[str, Summary]:
    """Each command ``warmup + repeats`` times, interleaved; a :class:`Summary` of the timed ones.

    Interleaved (round after round of every command) so that a slow spell of the machine
    falls on every command alike. ``run`` measures one command (default :func:`measure`);
    ``before`` is called (untimed) before every run, e.g. to drop caches. With ``rotate``,
    round ``i`` (warm-up rounds counted) runs the commands in :func:`rotated_order`, so that
    no command always has the same place or follows the same command; else in order.
    """
    out = {name: Summary(name) for name in commands}
    for i in range(warmup + repeats):
        for name in rotated_order(list(commands), i) if rotate else commands:
            if before is not None:
                before()
            m = run(commands[name])
            if i >= warmup:
                out[name].add(m)
    return out


def median_runs(
    label: str,
    cmd: Sequence[str],
    repeats: int,
    *,
    warmup: int = 1,
    before: Callable[[], None] | None = None,
    **kwargs,
) -> Summary:
    """Run ``cmd`` ``warmup`` + ``repeats`` times; :class:`Summary` of the timed ones.

    ``before`` is called (untimed) before every run, e.g. to drop caches; ``kwargs`` go to
    :func:`measure`.
    """
    rounds = interleaved_rounds(
        {label: cmd}, repeats, lambda c: measure(c, **kwargs), warmup=warmup, before=before
    )
    return rounds[label]


# The interpreter python_command runs (the one ckpt_tools is installed in): use_ckpt sets it.
_CKPT_PYTHON = [PYTHON]


def python_command(code: str, *args: str | os.PathLike[str]) -> list[str]:
    """``python -c CODE ARGS...`` with the interpreter ``ckpt`` runs in (:func:`use_ckpt`).

    With ``-P`` (Python 3.11+): the working folder is not put on ``sys.path``, so a checkout
    there does not stand in for the installation being timed.
    """
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [_CKPT_PYTHON[0], *safe, "-c", code, *(os.fspath(a) for a in args)]


def ckpt_command(*args: str | os.PathLike[str]) -> list[str]:
    """The installed ``ckpt`` console script (or ``python -m ckpt_tools``) with ARGS."""
    return [*CKPT, *(os.fspath(a) for a in args)]


def use_ckpt(python: str, script: str) -> None:
    """Time this installation from now on: :func:`ckpt_command` and :func:`python_command`."""
    CKPT[:] = [script]
    _CKPT_PYTHON[0] = python


@contextlib.contextmanager
def installed_copy(folder: Path) -> Iterator[tuple[str, str]]:
    """A regular (non-editable) install of this checkout, as users have it: (python, ckpt).

    The development venv installs ckpt_tools editable, and setuptools' editable finder runs
    at every interpreter start (it imports pathlib and urllib: about 14 ms here) where an
    installed package costs nothing. This makes, in ``folder``, a venv without pip whose
    site-packages holds a compiled copy of ``ckpt_tools`` and a ``.pth`` naming the
    development venv's site-packages (click, numpy, torch: that folder's own ``.pth`` files,
    the editable finder among them, are not run), and the console script pip wrote there,
    with this venv's interpreter in its first line. Removed on exit.
    """
    venv = folder / "installed-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "dependencies.pth").write_text(deps + "\n")
    shutil.copytree(
        REPO / "ckpt_tools", site / "ckpt_tools", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run([str(python), "-m", "compileall", "-q", str(site / "ckpt_tools")], check=True)
    script = venv / "bin" / "ckpt"
    body = _CKPT_SCRIPT.read_text().split("\n", 1)[1] if _CKPT_SCRIPT.exists() else ""
    if "ckpt_tools" not in body:
        body = "import sys\nfrom ckpt_tools.cli.main import run\nsys.exit(run())\n"
    script.write_text(f"#!{python}\n{body}")
    script.chmod(0o755)
    try:
        yield str(python), str(script)
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def ckpt_json(*args: str | os.PathLike[str]) -> dict[str, Any]:
    """One untimed ``ckpt ARGS --quiet --json`` run (it must succeed): its JSON result."""
    proc = subprocess.run(
        ckpt_command(*args, "--quiet", "--json"), capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout)


# --------------------------------------------------------------------------- reporting


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def verdict(name: str, value: float, limit: float, unit: str, ok: bool | None = None) -> str:
    ok = value <= limit if ok is None else ok
    return f"{'PASS' if ok else 'FAIL'}  {name}: {value:.3g} {unit} (target <= {limit:g} {unit})"


def fmt_table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> str:
    """A plain left/right-aligned text table (no third-party imports)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        )

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def load_note() -> str:
    """The 1/5/15-minute load averages: other work on the machine inflates and spreads timings."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "load average: unknown"
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` figure (``MemTotal``, ``MemFree`` ...) in bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_note() -> str:
    """CPU count, RAM, Python and torch versions (torch version read without importing it)."""
    try:
        from importlib.metadata import version

        torch_v = version("torch")
    except Exception:
        torch_v = "?"
    total = meminfo_bytes("MemTotal")
    mem = f"{total / (1 << 30):.0f} GiB RAM" if total is not None else "? RAM"
    return (
        f"{os.cpu_count()} CPUs, {mem}, Python {sys.version.split()[0]}, torch {torch_v}, "
        f"peak RSS via {rss_method()}"
    )
