"""Where a large page-cache copy spends its time: output offsets, folio sizes and cold memory.

Run:  .venv/bin/python benchmarks/bench_page_cache.py [--size-mb 4096] [--rounds 3]

Why it exists: ``ckpt strip-module --no-fsync`` copies tensor bytes with ``copy_file_range``
in calls that start on a 64 KiB boundary of the output (``io/copy/clone.py``,
``_KERNEL_ALIGN``), so that the kernel fills the output's page cache with 64 KiB folios
rather than 4 KiB ones; on a VM, its ratio to ``cp`` at 4 GiB swung several-fold from run to
run (benchmarks/README.md). This script takes the ``ckpt`` process, the checkpoint format and
``cp`` out of it and times the kernel's copy alone, 256 MiB per call, for:

* ``aligned``: every call starts on a 64 KiB boundary (as strip-module does);
* ``unaligned``: every call starts 4 KiB past one (as a copy whose records sit anywhere);

each one in two memory states:

* ``idle``: the machine sat idle for ``--idle`` seconds first (default 4);
* ``touched``: ``--touch-mb`` of anonymous memory was written and released just before.

It prints each run's total and its time per GiB of output. A machine whose free memory is
always backed (bare metal, most cloud VMs) shows the same profile in both states. A VM whose
host takes free guest memory back (virtio-balloon free page reporting, Hyper-V's dynamic
memory) shows calls that slow down several-fold once the copy's new page-cache folios have
to come from that memory; which calls, depends on the folio size, because the kernel hands
out large blocks (where such memory is) for 64 KiB folios first and small free fragments for
4 KiB ones. Where the kernel exposes it, the amount of memory reported to the host during
each run is printed too.

The input is a file of random bytes in a temp folder (removed at the end), read once first
so that it stays in the page cache; every output is deleted and ``sync`` run, untimed.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MIB, fmt_table, machine_note, meminfo_bytes, sync_all, workdir

CALL = 256 * MIB
FOLIO = 64 << 10
PAGE = 4096
REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int | None:
    """Memory the guest has reported free to its host so far (a patched kernel's counter)."""
    try:
        return int(REPORTED.read_text())
    except (OSError, ValueError):
        return None


def touch(nbytes: int) -> None:
    """Write every page of ``nbytes`` of anonymous memory, then release it."""
    block = b"\1" * CALL
    if nbytes <= 0:
        return
    with mmap.mmap(-1, nbytes) as m:
        for off in range(0, nbytes, CALL):
            m[off : off + min(CALL, nbytes - off)] = block[: min(CALL, nbytes - off)]


def copy_profile(src: Path, out: Path, first: int) -> list[float]:
    """Copy ``src`` to ``out`` in 256 MiB calls after a first call of ``first`` bytes."""
    size = src.stat().st_size
    times: list[float] = []
    s = os.open(src, os.O_RDONLY)
    try:
        d = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = os.copy_file_range(s, d, first, 0, 0) if first else 0
            while off < size:
                t = time.perf_counter()
                n = os.copy_file_range(s, d, min(CALL, size - off), off, off)
                times.append(time.perf_counter() - t)
                if n == 0:
                    raise OSError(f"source ended at {off} of {size} bytes")
                off += n
        finally:
            os.close(d)
    finally:
        os.close(s)
    out.unlink()
    sync_all()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=4096, help="file size (MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each variant and state")
    ap.add_argument("--idle", type=float, default=4.0, help="seconds idle before an idle run")
    ap.add_argument("--touch-mb", type=int, default=6144, help="memory written before a run")
    ap.add_argument("--workdir", default=None, help="parent folder for the generated file")
    args = ap.parse_args(argv)
    if not hasattr(os, "copy_file_range"):
        print("SKIP  os.copy_file_range is not available here")
        return 0
    print(f"machine: {machine_note()}")
    variants = {"aligned": 0, "unaligned": FOLIO - PAGE}
    touch_bytes = 0
    states = {"idle": lambda: time.sleep(args.idle), "touched": lambda: touch(touch_bytes)}
    results: dict[tuple[str, str], list[list[float]]] = {}
    reported: dict[tuple[str, str], list[int]] = {}
    with workdir(args.workdir) as folder:
        src, out = folder / "input.bin", folder / "output.bin"
        with open(src, "wb") as f:
            for _ in range(0, args.size_mb * MIB, CALL):
                f.write(os.urandom(min(CALL, args.size_mb * MIB - f.tell())))
        sync_all()
        copy_profile(src, out, 0)  # untimed: reads the input into the page cache
        touch_bytes = min(args.touch_mb * MIB, max((meminfo_bytes("MemFree") or 0) - 512 * MIB, 0))
        print(f"touched state: {touch_bytes / MIB:.0f} MiB written and released before each run")
        for r in range(args.rounds):
            for state, prepare in states.items():
                for name, first in variants.items() if r % 2 == 0 else reversed(variants.items()):
                    prepare()
                    before = reported_kib()
                    times = copy_profile(src, out, first)
                    after = reported_kib()
                    results.setdefault((name, state), []).append(times)
                    if before is not None and after is not None:
                        reported.setdefault((name, state), []).append((after - before) // 1024)
                    print(f"round {r + 1}: {name:9} {state:7} {sum(times):6.2f} s", flush=True)
    per_gib = (1 << 30) // CALL
    rows = []
    for (name, state), runs in results.items():
        totals = [sum(t) for t in runs]
        best = runs[totals.index(statistics.median_low(totals))]
        gib = [sum(best[i : i + per_gib]) for i in range(0, len(best), per_gib)]
        note = f"{statistics.median(reported[(name, state)])} MiB" if reported else "n/a"
        rows.append(
            [
                name,
                state,
                f"{statistics.median(totals):.2f}",
                " ".join(f"{g:.2f}" for g in gib),
                note,
            ]
        )
    headers = ["output calls", "memory", "median s", "s per GiB (median run)", "reported"]
    print(fmt_table(rows, headers))
    print(
        "aligned: calls start on a 64 KiB boundary (64 KiB folios); unaligned: 4 KiB past one "
        "(folios of 4-32 KiB). 'reported': memory handed back to the host during the run."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
