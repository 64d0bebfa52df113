"""How ``ckpt strip-module IN OUT`` compares with ``cp IN OUT`` and with the naive torch way.

Run:  .venv/bin/python benchmarks/bench_rewrite.py [--sizes-mb 1024] [--reflink-sizes-mb 1024,4096]

Generates, in a temp folder (removed at the end), a ~SIZE MiB ``.pt`` and ``.safetensors``
with ~350 float32 tensors whose keys are DataParallel-wrapped (``module.layers.{i}...``), and
measures, per format, as interleaved rounds (cp, strip, naive, then strip, naive, cp, ...:
each round starts one command further along, and every other block of rounds goes in
reverse order, so no command always has the same place or follows the same command; one
untimed warm-up round first, then REPEATS timed rounds; medians reported):

* ``cp IN OUT``                                   (coreutils; copy_file_range on Linux);
* ``ckpt strip-module IN OUT --quiet``            (the installed console script: re-pickles
  data.pkl or writes a new header, writes the tensor bytes straight to the disk (O_DIRECT;
  copy_file_range for the unaligned ends) into a temp file, fsyncs, renames, fsyncs the
  folder, re-reads the output to verify keys and sizes); with ``--no-fsync``, the tensor
  bytes are copied through the page cache with copy_file_range, as ``cp`` copies them, and
  nothing is fsynced;
* naive: ``torch.load`` + key loop + ``torch.save`` (.pt), or
  ``safetensors.torch.load_file`` + key loop + ``save_file`` (.safetensors).

Writeback is charged fairly: after every command its output is fsynced, timed, and that
time is added to the command's ("total" column; strip-module fsyncs its own output, so its
extra fsync finds nothing to write). Then the output is deleted and ``sync`` runs, untimed,
so no command pays for another's writeback or deletion. Inputs stay in the page cache (the
warm-up round reads them); outputs are written fresh every time.

Ratios are medians of interleaved pairs: round i's strip-module against round i's cp, then
the median over rounds. Two baselines from the same cp runs: plain ``cp`` (its wall time, no
sync) and ``cp`` + ``sync`` (its wall time plus the timed fsync of its output).

Targets (per format and size): the durable strip-module <= 1.0x ``cp`` + fsync of its output,
``--no-fsync`` <= 1.3x plain ``cp`` (like for like: neither syncs), and peak RSS <= 150 MB.

What is timed: a regular install of this checkout, made in the temp folder (a venv whose
site-packages holds a compiled copy of ``ckpt_tools``), as users have it; ``--editable`` times
the development venv instead, whose editable-install finder adds about 14 ms to every start.

The start: ``python -c pass``, ``import click``, ``ckpt --version`` and ``--help``, and how
long ``ckpt strip-module`` takes from exec to its first open of the input (noted in the
process by an audit hook, on the parent's clock), medians.

Reflinks: run as root with ``mkfs.xfs`` (``apt-get install xfsprogs``), the script makes a
sparse loopback XFS image with ``reflink=1``, mounts it, copies the inputs in, and times
strip-module there beside ``cp --reflink=never`` (the baseline) and ``cp --reflink=always``,
at each of ``--reflink-sizes-mb``. Target: at most 0.15 s at 4 GiB, flat in file size.
Otherwise it says why it skips.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MIB,
    PYTHON,
    REPO,
    SYNCED_HEADERS,
    GeneratedPair,
    Summary,
    cache_state_note,
    ckpt_command,
    ckpt_json,
    fmt_table,
    installed_copy,
    interleaved_rounds,
    load_note,
    machine_note,
    make_checkpoints,
    measure,
    python_command,
    sync_all,
    synced_cells,
    synced_run,
    use_ckpt,
    verdict,
    workdir,
)

TARGET_DURABLE = 1.0  # durable strip-module / (cp + fsync)
TARGET_FAST = 1.3  # strip-module --no-fsync / plain cp
LARGE_MB = 4096
TARGET_MB = 150.0
TARGET_REFLINK_S = 0.15  # at LARGE_MB on the loopback XFS
STRIP = "ckpt strip-module IN OUT --quiet"
NO_DIRECT = "  same, no direct write"
ABLATED = "  same, no direct write, no early writeback"
UNSPLIT = "  --no-fsync, no 64 KiB split"
FAST = "ckpt strip-module IN OUT --quiet --no-fsync"
UNVERIFIED = "  same, --verify none"
# strip-module with one part of the copy engine undone.
PATCHED = (
    "import sys\nimport ckpt_tools.io.copy.clone as c\n{patch}\n"
    "from ckpt_tools.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
)
# The durable output's tensor bytes go through the page cache, as before the direct writes
# (io/copy/direct.py), with the early writeback (sync_file_range every 64 MiB).
NO_DIRECT_CODE = PATCHED.format(patch="c.direct_span = lambda *args: (0, 0)")
# ... and without the early writeback, which also makes each copy_file_range call as long
# as the kernel allows: does it still pay?
NO_WRITEBACK_CODE = PATCHED.format(
    patch="c.direct_span = lambda *args: (0, 0)\nc._WRITEBACK_EVERY = 1 << 62"
)
# --no-fsync, with its kernel copies started wherever the run starts, not split at the
# output's first 64 KiB boundary (does the split still pay?).
NO_SPLIT_CODE = PATCHED.format(patch="c._KERNEL_ALIGN = 1")

NAIVE_PT = (
    "import sys, torch\n"
    "sd = torch.load(sys.argv[1], weights_only=True)\n"
    "sd = {(k[len('module.'):] if k.startswith('module.') else k): v for k, v in sd.items()}\n"
    "torch.save(sd, sys.argv[2])\n"
)
NAIVE_ST = (
    "import sys\n"
    "from safetensors.torch import load_file, save_file\n"
    "sd = load_file(sys.argv[1])\n"
    "sd = {(k[len('module.'):] if k.startswith('module.') else k): v for k, v in sd.items()}\n"
    "save_file(sd, sys.argv[2], metadata={'format': 'pt'})\n"
)


def check_outputs(src: Path, folder: Path, fmt: str) -> str:
    """One untimed strip-module run whose output is checked: keys stripped, loads in torch."""
    out = folder / f"check_out.{fmt}"
    result = ckpt_json("strip-module", src, out)
    code = (
        "import sys, torch\nsd = torch.load(sys.argv[1], weights_only=True, mmap=True)\n"
        if fmt == "pt"
        else "import sys\nfrom safetensors.torch import load_file\nsd = load_file(sys.argv[1])\n"
    ) + (
        "assert not any(k.startswith('module.') for k in sd), 'keys not stripped'\nprint(len(sd))\n"
    )
    loaded = subprocess.run(
        python_command(code, out), capture_output=True, text=True, check=True
    ).stdout.strip()
    out.unlink()
    sync_all()
    return (
        f"check: {result['renamed']}/{result['total_keys']} keys renamed, "
        f"{result['verification']}; the output loads with torch/safetensors ({loaded} tensors)"
    )


def paired(a: Summary, b: Summary, attr: str = "total_s") -> float:
    """The median over rounds of a's run divided by b's run in the same round."""
    return statistics.median(
        getattr(x, attr) / getattr(y, attr) for x, y in zip(a.runs, b.runs, strict=True)
    )


def interleaved(commands: dict[str, list[str]], out: Path, repeats: int) -> dict[str, Summary]:
    """One untimed warm-up round, then ``repeats`` rounds of every command, each run writing
    ``out`` (:func:`common.synced_run`), in :func:`common.rotated_order` (why: its docstring)."""
    print(f"measuring: 1 warm-up round + {repeats} timed rounds, interleaved ...", flush=True)
    return interleaved_rounds(commands, repeats, lambda cmd: synced_run(cmd, out), rotate=True)


def report(results: dict[str, Summary], size_mib: float) -> None:
    cp = results["cp IN OUT"]
    rows = [
        [
            name,
            *synced_cells(s),
            f"{s.cpu_s:.3f}",
            f"{size_mib / s.total_s:.0f}",
            f"{s.peak_rss_mb:.1f}",
            f"{paired(s, cp, 'wall_s'):.2f}x",
            f"{paired(s, cp):.2f}x",
        ]
        for name, s in results.items()
    ]
    headers = ["command", *SYNCED_HEADERS, "cpu s", "MiB/s"]
    headers += ["peak RSS MB", "cmd / cp", "total / (cp+sync)"]
    print(fmt_table(rows, headers))


def bench_size(args: argparse.Namespace, folder: Path, pair: GeneratedPair, size_mb: float) -> bool:
    """Both formats at one size on the working folder's file system; True when targets pass."""
    ok = True
    for fmt in args.formats:
        src = getattr(pair, fmt)
        size_mib = src.stat().st_size / 2**20
        print(f"\n== .{fmt}: {pair.label}, file {size_mib:.1f} MiB ({fs_note(folder)}) ==")
        print(check_outputs(src, folder, fmt))
        out = folder / f"out.{fmt}"
        results = interleaved(size_commands(args, src, out, fmt, size_mb), out, args.repeats)
        report(results, size_mib)
        ok &= size_verdicts(results, f".{fmt} {size_mb:.0f} MiB")
    return ok


def size_commands(
    args: argparse.Namespace, src: Path, out: Path, fmt: str, size_mb: float
) -> dict[str, list[str]]:
    """``cp``, the durable and the ``--no-fsync`` strip-module, the ablations, the naive way."""
    verify_opt = ["--verify", args.verify] if args.verify else []
    commands = {
        "cp IN OUT": ["cp", str(src), str(out)],
        STRIP: ckpt_command("strip-module", src, out, "--quiet", *verify_opt),
        # Not durable, as `cp` is not: the like-for-like comparison with plain `cp`.
        FAST: ckpt_command("strip-module", src, out, "--quiet", "--no-fsync", *verify_opt),
    }
    if args.ablate:
        strip_args = ("strip-module", src, out, "--quiet")
        commands[NO_DIRECT] = python_command(NO_DIRECT_CODE, *strip_args)
        commands[ABLATED] = python_command(NO_WRITEBACK_CODE, *strip_args)
        commands[UNSPLIT] = python_command(NO_SPLIT_CODE, *strip_args, "--no-fsync")
    if not args.no_naive and size_mb <= args.naive_max_mb:
        naive = NAIVE_PT if fmt == "pt" else NAIVE_ST
        commands[f"naive {fmt} load + rename + save"] = [PYTHON, "-c", naive, str(src), str(out)]
    return commands


def size_verdicts(results: dict[str, Summary], name: str) -> bool:
    """Print the PASS/FAIL lines of one format and size; True when all pass."""
    strip, fast, cp = results[STRIP], results[FAST], results["cp IN OUT"]
    # Like for like: neither syncs; both synced (the fsync after `cp` is timed).
    plain, synced = paired(fast, cp, "wall_s"), paired(strip, cp)
    print(verdict(f"{name} strip-module --no-fsync / plain cp", plain, TARGET_FAST, "x"))
    print(verdict(f"{name} strip-module (durable) / (cp + fsync)", synced, TARGET_DURABLE, "x"))
    print(f"      {name} strip-module (durable) / plain cp: {paired(strip, cp, 'wall_s'):.2f}x")
    print(verdict(f"{name} strip-module peak RSS", strip.peak_rss_mb, TARGET_MB, "MB"))
    print(f"({load_note()})")
    return plain <= TARGET_FAST and synced <= TARGET_DURABLE and strip.peak_rss_mb <= TARGET_MB


def fs_note(folder: Path) -> str:
    proc = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE,OPTIONS", "-T", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or "file system unknown"


# The console script's own code, run with an audit hook that notes (CLOCK_MONOTONIC, as the
# parent's clock) when the process first opens the input; the hook costs microseconds.
_FIRST_OPEN = """
import os, sys, time
src = os.path.abspath(sys.argv[1])
first = []

def hook(event, args):
    if event == "open" and not first and isinstance(args[0], str):
        if os.path.abspath(args[0]) == src:
            first.append(time.monotonic())

sys.addaudithook(hook)
sys.argv = ["ckpt", "strip-module", "--quiet", sys.argv[1], sys.argv[2]]
from ckpt_tools.cli.main import run
try:
    run()
finally:
    sys.stderr.write(f"FIRST-OPEN {first[0]!r}\\n")
"""


def _exec_to_first_open(src: Path, out: Path) -> float:
    """Seconds from just before exec to the input's first open, for one strip-module."""
    start = time.monotonic()
    run = subprocess.run(
        python_command(_FIRST_OPEN, src, out), capture_output=True, text=True, check=True
    )
    line = next(x for x in run.stderr.splitlines() if x.startswith("FIRST-OPEN "))
    return float(line.split()[1]) - start


_FIRST = "  strip-module: exec to first open of the input"


def bench_start(repeats: int, folder: Path, install: str) -> None:
    """Interpreter floor, click's import, ``ckpt --version`` and ``--help``, and how long
    strip-module takes from exec to its first read of the input."""
    print(f"\n== start ({install}) ==")
    src = make_checkpoints(folder, 1, 7, stem="tiny", formats=("pt",)).pt
    out = folder / "tiny_out.pt"
    commands = {
        "python -c pass": python_command("pass"),
        "python -c pass (the development venv)": [PYTHON, "-c", "pass"],
        "python -I -S -c pass": [PYTHON, "-I", "-S", "-c", "pass"],
        "python -c 'import click'": python_command("import click"),
        "ckpt --version": ckpt_command("--version"),
        "ckpt --help": ckpt_command("--help"),
        "ckpt strip-module (tiny)": ckpt_command("strip-module", src, out, "--quiet"),
    }
    # Interleaved rounds: this machine's speed drifts, and each row is compared with the others.
    walls: dict[str, list[float]] = {name: [] for name in [*commands, _FIRST]}
    for i in range(1 + repeats):
        for name, cmd in commands.items():
            wall = measure(cmd).wall_s
            out.unlink(missing_ok=True)
            if i:
                walls[name].append(wall)
        first = _exec_to_first_open(src, out)
        out.unlink(missing_ok=True)
        if i:
            walls[_FIRST].append(first)
    rows = [
        [name, f"{1000 * statistics.median(w):.0f}", f"{1000 * min(w):.0f}"]
        for name, w in walls.items()
    ]
    firsts = walls[_FIRST]
    print(fmt_table(rows, ["command", "median ms", "best ms"]))
    verdict = "PASS" if statistics.median(firsts) <= 0.060 else "FAIL"
    print(
        f"{verdict}  strip-module, exec to first read: "
        f"{1000 * statistics.median(firsts):.0f} ms (target <= 60 ms; an audit hook in the "
        "process notes the open; `python -c 'import click'` above is what any click command "
        "pays before it can parse its arguments)"
    )


@contextlib.contextmanager
def loopback_xfs(parent: Path, size_bytes: int) -> Iterator[Path | str]:
    """Mount a sparse XFS image (reflink=1) under ``parent``; yields why not, as a string."""
    if os.geteuid() != 0:
        yield "not root (mounting a loop device needs it)"
        return
    if shutil.which("mkfs.xfs") is None:
        yield "mkfs.xfs not found (apt-get install xfsprogs)"
        return
    image, mount = parent / "xfs.img", parent / "xfs"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    try:
        for cmd in (
            ["mkfs.xfs", "-q", "-m", "reflink=1", str(image)],
            ["mount", "-o", "loop", str(image), str(mount)],
        ):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                yield f"{cmd[0]} failed: {proc.stderr.strip()[-200:]}"
                return
        try:
            yield mount
        finally:
            subprocess.run(["umount", str(mount)], check=False)
    finally:
        image.unlink(missing_ok=True)


def bench_reflink(
    args: argparse.Namespace, mount: Path, pair: GeneratedPair, size_mb: float, rows: list
) -> bool:
    """strip-module on the loopback XFS: flat in size, at most 0.15 s at 4 GiB."""
    ok = True
    for fmt in args.formats:
        src = mount / f"in.{fmt}"
        subprocess.run(["cp", "--reflink=never", str(getattr(pair, fmt)), str(src)], check=True)
        sync_all()
        print(f"\n== xfs (reflink=1, loopback) .{fmt}: {pair.label} ==")
        out = mount / f"out.{fmt}"
        commands = {
            "cp IN OUT": ["cp", "--reflink=never", str(src), str(out)],
            "cp --reflink=always": ["cp", "--reflink=always", str(src), str(out)],
            STRIP: ckpt_command("strip-module", src, out, "--quiet"),
            FAST: ckpt_command("strip-module", src, out, "--quiet", "--no-fsync"),
            # What is left once the output is not read back: the open, the plan, the copy.
            UNVERIFIED: ckpt_command("strip-module", src, out, "--quiet", "--verify", "none"),
        }
        results = interleaved(commands, out, args.repeats)
        report(results, src.stat().st_size / MIB)
        strip, fast = results[STRIP], results[FAST]
        rows.append(
            [
                f"{size_mb:.0f} MiB .{fmt}",
                f"{strip.total_s:.3f}",
                f"{strip.cpu_s:.3f}",
                f"{fast.wall_s:.3f}",
            ]
        )
        if size_mb >= LARGE_MB:
            ok &= strip.total_s <= TARGET_REFLINK_S
            name = f"xfs .{fmt} {size_mb:.0f} MiB strip-module"
            print(verdict(name, strip.total_s, TARGET_REFLINK_S, "s"))
        src.unlink()
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="1024", help="sizes (MiB) on the work folder's disk")
    ap.add_argument(
        "--reflink-sizes-mb", default="1024,4096", help="sizes (MiB) on the loopback XFS"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median; >= 5 advised)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors in the checkpoint")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    ap.add_argument("--formats", default="pt,safetensors", help="comma-separated: pt,safetensors")
    ap.add_argument("--no-naive", action="store_true", help="skip the torch.load/save baseline")
    ap.add_argument(
        "--naive-max-mb", type=float, default=1024, help="naive baseline up to this size"
    )
    ap.add_argument("--no-reflink", action="store_true", help="skip the loopback XFS part")
    ap.add_argument("--no-start", action="store_true", help="skip the start-time part")
    ap.add_argument(
        "--no-ablate",
        dest="ablate",
        action="store_false",
        help="skip the variants (no direct write, no early writeback, no 64 KiB split)",
    )
    ap.add_argument(
        "--verify",
        choices=["sizes", "full", "none"],
        default=None,
        help="pass --verify to strip-module (default: its own default, sizes)",
    )
    ap.add_argument(
        "--editable",
        action="store_true",
        help="time the development venv's editable install (default: a regular install of "
        "this checkout, made in the temp folder, as users have it)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    args.reflink_sizes = (
        [] if args.no_reflink else [float(s) for s in args.reflink_sizes_mb.split(",") if s.strip()]
    )
    return args


def print_setup() -> None:
    print(f"machine: {machine_note()}")
    print(cache_state_note(False, None))
    print(
        "writeback: each command's output is fsynced (timed, added to 'total'), then deleted "
        "and `sync` run (untimed)"
    )
    print(f"before: {load_note()}")
    # Installed packages carry compiled bytecode; an editable checkout run with
    # PYTHONDONTWRITEBYTECODE=1 (as here) would compile every module at every start.
    # Forced: compileall trusts a .pyc whose recorded mtime matches the source's second, but
    # the import system also checks the size, so a file rewritten within the second of its
    # compile (a formatter's fix) would be recompiled at every start and slow the timings.
    subprocess.run([PYTHON, "-m", "compileall", "-q", "-f", str(REPO / "ckpt_tools")], check=True)
    print("bytecode: ckpt_tools compiled first (compileall), as an installed package is")


def bench_sizes(args: argparse.Namespace, folder: Path, mount: Path | str) -> bool:
    """Every size: generated once, timed on the work folder's disk and on the XFS."""
    ok = True
    rows: list[list[str]] = []
    for size_mb in sorted({*args.sizes, *args.reflink_sizes}):
        print(f"\ngenerating {size_mb:.0f} MiB checkpoints in {folder} ...", flush=True)
        pair = make_checkpoints(folder, size_mb, args.tensors, stem=f"wrapped{int(size_mb)}")
        if size_mb in args.sizes:
            ok &= bench_size(args, folder, pair, size_mb)
        if size_mb in args.reflink_sizes and isinstance(mount, Path):
            ok &= bench_reflink(args, mount, pair, size_mb, rows)
        for path in (pair.pt, pair.safetensors):
            path.unlink(missing_ok=True)
        os.sync()
    if isinstance(mount, str):
        print(f"\nSKIP  reflink benchmark (loopback XFS): {mount}")
    elif rows:
        print("\nxfs, strip-module by size (flat is the target):")
        print(fmt_table(rows, ["xfs input", "total s (median)", "cpu s", "--no-fsync s"]))
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A plain kill ends the run through `finally` blocks: the loop mount is unmounted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print_setup()
    with workdir(args.workdir, keep=args.keep) as folder, contextlib.ExitStack() as stack:
        free = shutil.disk_usage(folder).free
        largest = max([*args.sizes, *args.reflink_sizes], default=0) * MIB
        need = int(largest * 4.5)
        print(f"free disk: {free / 2**30:.1f} GiB (this run needs about {need / 2**30:.1f} GiB)")
        if free < need:
            print("FAIL  not enough free disk space")
            return 1
        install = "the development venv's editable install"
        if not args.editable:
            use_ckpt(*stack.enter_context(installed_copy(folder)))
            install = "a regular install of this checkout, in the temp folder"
        print(f"timing: {install}")
        if not args.no_start:
            bench_start(args.repeats, folder, install)
        mount: Path | str = "--no-reflink given"
        if args.reflink_sizes:
            size = int(max(args.reflink_sizes) * MIB * 2.5) + (1 << 30)
            mount = stack.enter_context(loopback_xfs(folder, size))
        all_ok = bench_sizes(args, folder, mount)
        os.sync()
    print(
        "PASS/FAIL use medians of interleaved pairs: strip-module against cp in the same "
        "round ('cmd / cp' without syncs, 'total / (cp+sync)' with each one's fsync)"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
