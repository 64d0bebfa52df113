"""Peak memory and time of ``ckpt_tools.diff`` on two large checkpoints, against loading both.

Run:  .venv/bin/python benchmarks/bench_diff.py [--size-mb 1024] [--repeats 3]

Generates, in a temp folder (removed at the end), two ~SIZE MiB ``.pt`` files with ~350
float32 tensors each (transformer-like shapes, random values). The second is the first with
small perturbations: 1 tensor in 10 gets ~1e-6 noise on a few elements, one gets a NaN,
one an extra 1e-3 offset. Then, as subprocesses (one untimed warm-up each, then REPEATS
timed runs, medians reported; inputs stay in the page cache):

* ``python -c "ckpt_tools.diff(A, B)"``    the library call, streamed tensor by tensor;
* ``ckpt diff A B --fail-on value``        the CLI (exit 1 expected: values differ);
* naive: ``torch.load`` both (mmap=False) and compare every pair with ``torch.equal``
  (skipped with ``--no-naive``).

Peak RSS is measured with GNU time or ``os.wait4`` (see ``common.measure``). Target:
diff peak RSS <= 300 MB whatever the input size (importing torch alone is ~230 MB).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MIB,
    Summary,
    cache_state_note,
    checkpoint_shapes,
    ckpt_command,
    fmt_table,
    machine_note,
    measure,
    python_command,
    save_pt,
    verdict,
    workdir,
)

TARGET_MB = 300.0

LIBRARY = (
    "import sys, ckpt_tools\n"
    "r = ckpt_tools.diff(sys.argv[1], sys.argv[2])\n"
    "print(len(r.tensors), sorted(r.found()), len(r.value_mismatches))\n"
)
NAIVE = (
    "import sys, torch\n"
    "a = torch.load(sys.argv[1], weights_only=True)\n"
    "b = torch.load(sys.argv[2], weights_only=True)\n"
    "print(sum(not torch.equal(a[k], b[k]) for k in a))\n"
)
IMPORT_ONLY = "import torch, ckpt_tools.diffing.engine\n"


def generate(folder: Path, size_mb: float, n_tensors: int) -> tuple[Path, Path, int]:
    """Write a.pt and the perturbed b.pt; returns their paths and the tensor bytes of one."""
    import torch

    shapes = checkpoint_shapes(int(size_mb * MIB), n_tensors, prefix="")
    g = torch.Generator().manual_seed(0)
    sd = {name: torch.rand(shape, generator=g) for name, shape in shapes}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    a, b = folder / "a.pt", folder / "b.pt"
    save_pt(a, sd)
    names = list(sd)
    for i, name in enumerate(names):
        if i % 10 == 3:
            flat = sd[name].view(-1)
            flat[:: max(1, flat.numel() // 7)] += 1e-6
    sd[names[5]].view(-1)[0] = math.nan
    sd[names[-1]].add_(1e-3)
    save_pt(b, sd)
    del sd
    return a, b, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="size of each checkpoint (MiB)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors per checkpoint")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per command (median)")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    ap.add_argument("--no-naive", action="store_true", help="skip the load-both baseline")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args(argv)

    print(f"machine: {machine_note()}")
    print(cache_state_note(False, None))
    with workdir(args.workdir, keep=args.keep) as folder:
        print(f"generating two checkpoints in {folder} ...", flush=True)
        a, b, nbytes = generate(folder, args.size_mb, args.tensors)
        print(f"tensor bytes: {nbytes / MIB:.0f} MiB per checkpoint")
        import gc

        gc.collect()
        inputs_mib = (a.stat().st_size + b.stat().st_size) / MIB
        print(f"inputs: 2 x {args.tensors} tensors, {inputs_mib:.0f} MiB together")
        commands = {
            "import torch + ckpt_tools.diffing.engine (floor)": (python_command(IMPORT_ONLY), 0),
            "ckpt_tools.diff(A, B)": (python_command(LIBRARY, a, b), 0),
            "ckpt diff A B --fail-on value": (ckpt_command("diff", a, b, "--fail-on", "value"), 1),
        }
        if not args.no_naive:
            commands["naive: torch.load both + torch.equal"] = (python_command(NAIVE, a, b), 0)
        results = {}
        for name, (cmd, expected) in commands.items():
            summary = Summary(name)
            for i in range(1 + args.repeats):
                m = measure(cmd, check=False)
                if m.returncode != expected:
                    raise SystemExit(f"{name}: exit {m.returncode}, expected {expected}")
                if i:
                    summary.add(m)
            results[name] = summary
        rows = [
            [
                name,
                f"{s.wall_s:.2f}",
                s.spread,
                f"{inputs_mib / s.wall_s:.0f}",
                f"{s.peak_rss_mb:.0f}",
                f"{inputs_mib:.0f}",
            ]
            for name, s in results.items()
        ]
        print(
            fmt_table(
                rows, ["command", "wall s", "min-max s", "MiB/s", "peak RSS MB", "inputs MiB"]
            )
        )
        lib = results["ckpt_tools.diff(A, B)"]
        cli = results["ckpt diff A B --fail-on value"]
        ok = lib.peak_rss_mb <= TARGET_MB and cli.peak_rss_mb <= TARGET_MB
        print(verdict("ckpt_tools.diffing.engine peak RSS", lib.peak_rss_mb, TARGET_MB, "MB"))
        print(verdict("ckpt diff peak RSS", cli.peak_rss_mb, TARGET_MB, "MB"))
        os.sync()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
