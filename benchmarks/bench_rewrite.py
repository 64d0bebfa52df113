"""How ``ckpt strip-module IN OUT`` compares with ``cp IN OUT`` and with the naive torch way.

Run:  .venv/bin/python benchmarks/bench_rewrite.py [--size-mb 1024] [--repeats 5]

Generates, in a temp folder (removed at the end), a ~SIZE MiB ``.pt`` and ``.safetensors``
with ~350 float32 tensors whose keys are DataParallel-wrapped (``module.layers.{i}...``), and
measures, per format, as interleaved rounds (cp, strip, naive, cp, strip, naive, ...; one
untimed warm-up round first, then REPEATS timed rounds; medians reported):

* ``cp IN OUT``                                   (coreutils; copy_file_range on Linux);
* ``ckpt strip-module IN OUT --quiet``            (the installed console script: re-pickles
  data.pkl or writes a new header, copies tensor bytes with copy_file_range into a temp
  file, fsyncs, renames, fsyncs the folder, re-reads the output to verify keys and sizes);
* naive: ``torch.load`` + key loop + ``torch.save`` (.pt), or
  ``safetensors.torch.load_file`` + key loop + ``save_file`` (.safetensors).

Writeback is charged fairly: after every command its output is fsynced, timed, and that
time is added to the command's ("total" column; strip-module fsyncs its own output, so its
extra fsync finds nothing to write). Then the output is deleted and ``sync`` runs, untimed,
so no command pays for another's writeback or deletion. Inputs stay in the page cache (the
warm-up round reads them); outputs are written fresh every time.

Targets (per format): strip-module total <= 1.3x cp total, and peak RSS <= 150 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PYTHON,
    Measurement,
    Summary,
    cache_state_note,
    ckpt_command,
    fmt_table,
    load_note,
    machine_note,
    make_checkpoints,
    measure,
    python_command,
    ratio,
    sync_all,
    sync_file,
    verdict,
    workdir,
)

TARGET_RATIO = 1.3
TARGET_MB = 150.0

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


def run_once(cmd: list[str], out: Path) -> Measurement:
    """Run ``cmd`` (which writes ``out``), fsync ``out`` (timed), delete it, ``sync`` (untimed)."""
    m = measure(cmd)
    extra = sync_file(out)
    out.unlink()
    sync_all()
    return Measurement(m.wall_s, m.peak_rss_kb, m.returncode, extra_s=extra)


def check_outputs(src: Path, folder: Path, fmt: str) -> str:
    """One untimed strip-module run whose output is checked: keys stripped, loads in torch."""
    out = folder / f"check_out.{fmt}"
    proc = subprocess.run(
        ckpt_command("strip-module", src, out, "--quiet", "--json"),
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(proc.stdout)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="checkpoint size (MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median; >= 5 advised)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors in the checkpoint")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    ap.add_argument("--formats", default="pt,safetensors", help="comma-separated: pt,safetensors")
    ap.add_argument("--no-naive", action="store_true", help="skip the torch.load/save baseline")
    ap.add_argument(
        "--verify",
        choices=["sizes", "full", "none"],
        default=None,
        help="pass --verify to strip-module (default: its own default, sizes)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]

    print(f"machine: {machine_note()}")
    print(cache_state_note(False, None))
    print(
        "writeback: each command's output is fsynced (timed, added to 'total'), then deleted "
        "and `sync` run (untimed)"
    )
    print(f"before: {load_note()}")
    all_ok = True
    with workdir(args.workdir, keep=args.keep) as folder:
        print(f"generating checkpoints in {folder} ...", flush=True)
        pair = make_checkpoints(folder, args.size_mb, args.tensors, stem="wrapped")
        import gc

        gc.collect()
        verify_opt = ["--verify", args.verify] if args.verify else []
        for fmt in formats:
            src = getattr(pair, fmt)
            size_mib = src.stat().st_size / 2**20
            print()
            print(f"== .{fmt}: {pair.label}, file {size_mib:.1f} MiB ==")
            print(check_outputs(src, folder, fmt))
            out = folder / f"out.{fmt}"
            commands = {
                "cp IN OUT": ["cp", str(src), str(out)],
                "ckpt strip-module IN OUT --quiet": ckpt_command(
                    "strip-module", src, out, "--quiet", *verify_opt
                ),
            }
            if not args.no_naive:
                naive = NAIVE_PT if fmt == "pt" else NAIVE_ST
                label = (
                    "naive torch.load + loop + torch.save"
                    if fmt == "pt"
                    else "naive load_file + loop + save_file"
                )
                commands[label] = [PYTHON, "-c", naive, str(src), str(out)]
            results = {name: Summary(name) for name in commands}
            print(f"measuring: 1 warm-up round + {args.repeats} timed rounds, interleaved ...")
            for i in range(1 + args.repeats):
                for name, cmd in commands.items():
                    m = run_once(cmd, out)
                    if i >= 1:
                        results[name].add(m)
            cp = results["cp IN OUT"]
            rows = []
            for name, s in results.items():
                rows.append(
                    [
                        name,
                        f"{s.wall_s:.3f}",
                        f"{s.extra_s:.3f}",
                        f"{s.total_s:.3f}",
                        s.spread,
                        f"{size_mib / s.total_s:.0f}",
                        f"{s.peak_rss_mb:.1f}",
                        ratio(s.total_s, cp.total_s),
                        ratio(s.best_s, cp.best_s),
                    ]
                )
            print(
                fmt_table(
                    rows,
                    [
                        "command",
                        "cmd s",
                        "+fsync s",
                        "total s",
                        "min-max total",
                        "MiB/s",
                        "peak RSS MB",
                        "total / cp",
                        "best / best cp",
                    ],
                )
            )
            strip = results["ckpt strip-module IN OUT --quiet"]
            r = strip.total_s / cp.total_s
            ok_ratio = r <= TARGET_RATIO
            ok_rss = strip.peak_rss_mb <= TARGET_MB
            all_ok &= ok_ratio and ok_rss
            print(verdict(f".{fmt} strip-module / cp (total)", r, TARGET_RATIO, "x"))
            print(verdict(f".{fmt} strip-module peak RSS", strip.peak_rss_mb, TARGET_MB, "MB"))
            if not args.no_naive:
                naive_s = results[label]
                print(
                    f"      naive / strip-module: {ratio(naive_s.total_s, strip.total_s)} time, "
                    f"{ratio(naive_s.peak_rss_mb, strip.peak_rss_mb)} peak RSS"
                )
            print(f"({load_note()})")
        os.sync()
    print(
        "PASS/FAIL use the median 'total' (command + fsync of its output); 'best / best cp' "
        "compares the fastest runs, which other load on the machine disturbs least"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
