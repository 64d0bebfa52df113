"""How ``ckpt sanitize IN OUT`` compares with ``cp IN OUT`` and with the trusting torch way.

Run:  .venv/bin/python benchmarks/bench_sanitize.py [--size-mb 1024] [--repeats 5]

Generates, in a temp folder (removed at the end), a trainer-style ``.pt`` of ~SIZE MiB that
``torch.load(weights_only=True)`` refuses: ``{"model": <pickled nn.Sequential of Linear
layers>, "config": {numpy arrays and scalars}, "args": argparse.Namespace, "epoch": 3}``, and
measures, as interleaved rounds (one untimed warm-up round, then REPEATS timed; medians):

* ``cp IN OUT``;
* ``ckpt sanitize IN OUT`` (the console script: restricted unpickling, tree conversion,
  tensor records copied with copy_file_range, numpy bytes as new records, fsync, verify);
* trusting: ``torch.load(weights_only=False)`` (runs the pickle), ``model.state_dict()``,
  numpy -> ``torch.from_numpy``, ``vars(args)``, ``torch.save``.

Each output is fsynced (timed, added to "total"), deleted, and ``sync`` run (untimed).
Targets: sanitize total <= 1.5x cp total, and peak RSS <= 150 MB.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PYTHON,
    Summary,
    ckpt_command,
    fmt_table,
    interleaved_rounds,
    load_note,
    machine_note,
    ratio,
    synced_run,
    verdict,
    workdir,
)

TARGET_RATIO = 1.5
TARGET_MB = 150.0

MAKE = (
    "import argparse, sys, numpy as np, torch\n"
    "size_mb, layers = float(sys.argv[2]), int(sys.argv[3])\n"
    "width = int((size_mb * 2**20 / 4 / layers) ** 0.5)\n"
    "model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])\n"
    "config = {'mean': np.arange(4096, dtype=np.float32), 'lr': np.float64(1e-3)}\n"
    "args = argparse.Namespace(lr=1e-3, name='run')\n"
    "torch.save({'model': model, 'config': config, 'args': args, 'epoch': 3}, sys.argv[1])\n"
)
TRUSTING = (
    "import sys, argparse, numpy as np, torch\n"
    "ckpt = torch.load(sys.argv[1], weights_only=False)\n"
    "ckpt['model'] = ckpt['model'].state_dict()\n"
    "ckpt['config'] = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v.item()\n"
    "                  for k, v in ckpt['config'].items()}\n"
    "ckpt['args'] = vars(ckpt['args'])\n"
    "torch.save(ckpt, sys.argv[2])\n"
)
CHECK = (
    "import sys, torch\n"
    "a = torch.load(sys.argv[1], weights_only=True)\n"
    "b = torch.load(sys.argv[2], weights_only=True)\n"
    "assert list(a) == list(b) and list(a['model']) == list(b['model'])\n"
    "assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])\n"
    "assert torch.equal(a['config']['mean'], b['config']['mean'])\n"
    "print(len(a['model']))\n"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="checkpoint size (MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    ap.add_argument("--layers", type=int, default=64, help="Linear layers in the model")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    return ap.parse_args(argv)


def check_output(src: Path, folder: Path) -> str:
    """One untimed run: sanitize's output equals the trusting conversion's, in torch."""
    out, ref = folder / "out.pt", folder / "ref.pt"
    subprocess.run(ckpt_command("sanitize", src, out), check=True, capture_output=True)
    subprocess.run([PYTHON, "-c", TRUSTING, str(src), str(ref)], check=True)
    n = subprocess.run(
        [PYTHON, "-c", CHECK, str(out), str(ref)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    out.unlink()
    ref.unlink()
    return f"check: sanitize output equals the trusting conversion ({n} model tensors)"


def report(results: dict[str, Summary]) -> bool:
    """Print the table and the PASS/FAIL lines; True when both targets pass."""
    cp_s = results["cp IN OUT"].total_s
    rows = [
        [name, f"{s.total_s:.3f}", s.spread, f"{s.peak_rss_mb:.1f}", ratio(s.total_s, cp_s)]
        for name, s in results.items()
    ]
    print(fmt_table(rows, ["command", "total s", "min-max", "peak RSS MB", "total / cp"]))
    san = results["ckpt sanitize IN OUT"]
    lines = [
        verdict("sanitize total / cp total", san.total_s / cp_s, TARGET_RATIO, "x"),
        verdict("sanitize peak RSS", san.peak_rss_mb, TARGET_MB, "MB"),
    ]
    print("\n".join(lines))
    return all(line.startswith("PASS") for line in lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"machine: {machine_note()}")
    print(f"before: {load_note()}")
    with workdir(args.workdir) as folder:
        src = folder / "trainer.pt"
        subprocess.run(
            [PYTHON, "-c", MAKE, str(src), str(args.size_mb), str(args.layers)], check=True
        )
        size_mib = src.stat().st_size / 2**20
        print(check_output(src, folder))
        out = folder / "out.pt"
        commands = {
            "cp IN OUT": ["cp", str(src), str(out)],
            "ckpt sanitize IN OUT": ckpt_command("sanitize", src, out),
            "trusting torch.load + convert + torch.save": [
                PYTHON,
                "-c",
                TRUSTING,
                str(src),
                str(out),
            ],
        }
        print(
            f"== file {size_mib:.1f} MiB, {args.layers} layers; 1 warm-up + "
            f"{args.repeats} timed rounds =="
        )
        results = interleaved_rounds(commands, args.repeats, lambda cmd: synced_run(cmd, out))
        ok = report(results)
    print(f"after: {load_note()}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
