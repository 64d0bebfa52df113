"""The copy engine alone: ``copy_range`` of one large range beside ``cp``, durable and not.

Run:  .venv/bin/python benchmarks/bench_copy.py [--size-mb 1024] [--rounds 7]

``bench_rewrite.py`` times whole commands, whose start, open, plan and verification are a
fixed cost that other load on the machine inflates. This script times only the bytes: a file
of random bytes (read once first, so it stays in the page cache) copied, in this process,

* ``copy_range, not durable``: as ``--no-fsync`` copies (no ``Writeback``: the page cache);
* ``copy_range, durable``: as a durable output is copied (``Writeback(durable=True)``: the
  whole pages ``O_DIRECT``, the ends through the page cache), then fsynced (timed);

beside ``cp IN OUT`` run as a subprocess (its fork and exec are in its time), its output then
fsynced (timed, added to its total). Source and output offsets agree modulo the page but not
modulo 64 KiB (100 and 4196), as a layout-preserving rewrite's do. Every output is deleted and
``sync`` run, untimed, after each copy. The rounds rotate the order (see bench_rewrite.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import MIB, fmt_table, load_note, machine_note, sync_all, sync_file, workdir

from ckpt_tools.io.copy.clone import Writeback, copy_range

SRC_OFFSET, DST_OFFSET = 100, 4196


def ours(src: Path, out: Path, durable: bool) -> tuple[float, float]:
    """One ``copy_range`` of all of ``src`` past its first 100 bytes: (copy s, fsync s)."""
    count = src.stat().st_size - SRC_OFFSET
    start = time.perf_counter()
    with open(src, "rb") as s, open(out, "wb") as d:
        told = Writeback(d.fileno(), durable=True) if durable else None
        copy_range(s.fileno(), SRC_OFFSET, d.fileno(), DST_OFFSET, count, writeback=told)
        copied = time.perf_counter() - start
        if durable:
            os.fsync(d.fileno())
    return copied, time.perf_counter() - start - copied


def cp(src: Path, out: Path) -> tuple[float, float]:
    start = time.perf_counter()
    subprocess.run(["cp", str(src), str(out)], check=True)
    copied = time.perf_counter() - start
    return copied, sync_file(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="bytes to copy (MiB)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (medians)")
    ap.add_argument("--workdir", default=None, help="parent folder (its file system is timed)")
    args = ap.parse_args(argv)
    print(f"machine: {machine_note()}\nbefore: {load_note()}")
    runs = {
        "cp IN OUT (+ fsync)": cp,
        "copy_range, not durable": lambda s, o: ours(s, o, durable=False),
        "copy_range, durable (+ fsync)": lambda s, o: ours(s, o, durable=True),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    with workdir(args.workdir) as folder:
        src, out = folder / "src.bin", folder / "out.bin"
        with open(src, "wb") as f:
            for _ in range(args.size_mb):
                f.write(os.urandom(MIB))
        src.read_bytes()  # into the page cache
        sync_all()
        names = list(runs)
        for i in range(1 + args.rounds):  # round 0 warms up, untimed
            for name in names[i % len(names) :] + names[: i % len(names)]:
                timed = runs[name](src, out)
                out.unlink()
                sync_all()
                if i:
                    times[name].append(timed)
    report(times)
    print(f"after: {load_note()}")
    return 0


def report(times: dict[str, list[tuple[float, float]]]) -> None:
    cp_runs = times["cp IN OUT (+ fsync)"]
    rows = []
    for name, runs in times.items():
        copy_s = statistics.median(c for c, _ in runs)
        total_s = statistics.median(c + f for c, f in runs)
        # Paired with the same round's cp: against plain cp, and against cp + fsync.
        plain = statistics.median(c / p for (c, _), (p, _) in zip(runs, cp_runs, strict=True))
        synced = statistics.median(
            (c + f) / (p + q) for (c, f), (p, q) in zip(runs, cp_runs, strict=True)
        )
        rows.append([name, f"{copy_s:.3f}", f"{total_s:.3f}", f"{plain:.2f}x", f"{synced:.2f}x"])
    headers = ["copy", "copy s", "+ fsync s", "copy / cp", "total / (cp + fsync)"]
    print(fmt_table(rows, headers))


if __name__ == "__main__":
    sys.exit(main())
