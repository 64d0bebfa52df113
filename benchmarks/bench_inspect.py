"""How long ``ckpt inspect FILE --json`` takes and how much memory it needs, beside torch.

Run:  .venv/bin/python benchmarks/bench_inspect.py [--size-mb 1024] [--repeats 5]

Generates, in a temp folder (removed at the end):

* a ~SIZE MiB ``.pt`` and ``.safetensors`` with ~350 float32 tensors (DataParallel keys);
* the same tensor count with 1/8 of the bytes, and 4x the tensors with the same bytes.

and measures each command as a subprocess (wall time and peak RSS, median of REPEATS runs
after one warm-up run, commands interleaved round-robin):

* ``ckpt inspect FILE --json > /dev/null`` (the installed console script);
* .pt: ``torch.load(FILE, mmap=True, weights_only=True)`` and listing its keys;
* .safetensors: ``safe_open(FILE, "pt")`` listing keys and shapes, and ``load_file(FILE)``;
* floors: ``python -c pass``, ``ckpt --version`` (interpreter + click) and ``import torch``.

Ratios are against the baselines measured in the same run. Targets (350 tensors, SIZE MiB):
inspect under 0.3 s and under 60 MB peak RSS, for both formats.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PYTHON,
    GeneratedPair,
    Summary,
    cache_state_note,
    ckpt_command,
    drop_caches,
    fmt_table,
    interleaved_rounds,
    load_note,
    machine_note,
    make_checkpoints,
    python_command,
    ratio,
    verdict,
    workdir,
)

TARGET_S = 0.3
TARGET_MB = 60.0

TORCH_MMAP = (
    "import sys, torch\n"
    "sd = torch.load(sys.argv[1], mmap=True, weights_only=True)\n"
    "print(len(sd), sum(t.numel() for t in sd.values()))\n"
)
ST_SAFE_OPEN = (
    "import sys\n"
    "from safetensors import safe_open\n"
    "with safe_open(sys.argv[1], framework='pt') as f:\n"
    "    keys = list(f.keys())\n"
    "    shapes = [f.get_slice(k).get_shape() for k in keys]\n"
    "print(len(keys), len(shapes))\n"
)
ST_LOAD_FILE = (
    "import sys\n"
    "from safetensors.torch import load_file\n"
    "sd = load_file(sys.argv[1])\n"
    "print(len(sd), sum(t.numel() for t in sd.values()))\n"
)


INSPECT_IN_PROCESS = (
    "import json, statistics, sys, time\n"
    "import ckpt_tools\n"
    "times = []\n"
    "for _ in range(int(sys.argv[2])):\n"
    "    start = time.perf_counter()\n"
    "    info = ckpt_tools.inspect(sys.argv[1])\n"
    "    json.dumps(info.to_json(), indent=2, default=str)\n"
    "    times.append(time.perf_counter() - start)\n"
    "print(statistics.median(times))\n"
)


def inprocess_ms(path: Path, calls: int) -> float:
    """Median milliseconds of ``ckpt_tools.inspect(path)`` + JSON, over ``calls`` calls."""
    proc = subprocess.run(
        python_command(INSPECT_IN_PROCESS, path, str(calls)),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(proc.stdout.strip()) * 1000


def profile_inspect(path: Path, top: int = 12) -> str:
    """Where ``ckpt inspect --json`` spends its time: imports (-X importtime), then cProfile."""
    lines = [f"--- profile of `ckpt inspect {path.name} --json` ---"]
    proc = subprocess.run(
        [PYTHON, "-X", "importtime", "-m", "ckpt_tools", "inspect", str(path), "--json"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=True,
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        parts = line[len("import time:") :].split("|")
        self_us, cum_us, name = int(parts[0]), int(parts[1]), parts[2]
        depth = (len(name) - len(name.lstrip())) // 2
        rows.append((depth, name.strip(), self_us, cum_us))
    top_level = [r for r in rows if r[0] == 0]
    total = sum(r[3] for r in top_level)
    lines.append(f"imports: {total / 1000:.1f} ms in all; top-level packages by cumulative time:")
    for _depth, name, _self, cum in sorted(top_level, key=lambda r: -r[3])[:8]:
        lines.append(f"  {cum / 1000:7.1f} ms  {name}")
    heavy = sorted((r for r in rows if r[0] > 0), key=lambda r: -r[2])[:8]
    lines.append("heaviest single modules (self time):")
    for _depth, name, self_us, _cum in heavy:
        lines.append(f"  {self_us / 1000:7.1f} ms  {name}")
    # cProfile of the command body, with imports already done (a second call in-process).
    from ckpt_tools.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()):
        main(["inspect", str(path), "--json"])  # warm: imports and page cache
        prof = cProfile.Profile()
        prof.enable()
        main(["inspect", str(path), "--json"])
        prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("cumulative")
    total_s = stats.total_tt  # type: ignore[attr-defined]
    lines.append(f"cProfile of the command itself (imports excluded): {total_s * 1000:.1f} ms")
    stats.print_stats(top)
    body = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(body) if ln.lstrip().startswith("ncalls")), 0)
    lines.extend("  " + ln for ln in body[start : start + top + 1])
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="main checkpoint size (MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per command (median)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors in the main checkpoint")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="drop the page cache before every run (root only; default: warm cache)",
    )
    ap.add_argument("--no-scaling", action="store_true", help="skip the 1/8-bytes and 4x files")
    ap.add_argument("--profile", action="store_true", help="always print the profile")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    return ap.parse_args(argv)


def make_inputs(args: argparse.Namespace, folder: Path) -> dict[str, GeneratedPair]:
    """The main pair and (unless ``--no-scaling``) the 1/8-bytes and 4x-tensors pairs."""
    print(f"generating checkpoints in {folder} ...", flush=True)
    pairs = {"main": make_checkpoints(folder, args.size_mb, args.tensors, stem="main")}
    if not args.no_scaling:
        pairs["eighth"] = make_checkpoints(
            folder, args.size_mb / 8, args.tensors, stem="eighth_bytes"
        )
        pairs["4x"] = make_checkpoints(
            folder, args.size_mb, args.tensors * 4, stem="four_x_tensors"
        )
    for key, p in pairs.items():
        print(
            f"  {key:6s} {p.label}: {p.pt.name} {p.pt.stat().st_size / 2**20:.1f} MiB, "
            f"{p.safetensors.name} {p.safetensors.stat().st_size / 2**20:.1f} MiB"
        )
    # Free this process's tensors' memory before measuring (measurements are subprocesses
    # whose RSS is their own, but a smaller parent keeps the machine quieter).
    import gc

    gc.collect()
    return pairs


PT, ST = "ckpt inspect .pt --json", "ckpt inspect .safetensors --json"
# The main table's rows, in order: (command, the ckpt inspect row it is compared with).
MAIN_ROWS = [
    ("python -c pass", None),
    ("ckpt --version", None),
    ("python -c 'import torch'", None),
    (PT, None),
    ("torch.load(.pt, mmap=True, weights_only=True)", PT),
    (ST, None),
    ("safe_open(.safetensors) keys+shapes", ST),
    ("safetensors.torch.load_file(.safetensors)", ST),
]


def inspect_commands(pairs: dict[str, GeneratedPair]) -> dict[str, list[str]]:
    """The main table's commands, then ``ckpt inspect`` of each scaling file."""
    pt, st = pairs["main"].pt, pairs["main"].safetensors
    commands = {
        "python -c pass": python_command("pass"),
        "ckpt --version": ckpt_command("--version"),
        "python -c 'import torch'": python_command("import torch"),
        PT: ckpt_command("inspect", pt, "--json"),
        "torch.load(.pt, mmap=True, weights_only=True)": python_command(TORCH_MMAP, pt),
        ST: ckpt_command("inspect", st, "--json"),
        "safe_open(.safetensors) keys+shapes": python_command(ST_SAFE_OPEN, st),
        "safetensors.torch.load_file(.safetensors)": python_command(ST_LOAD_FILE, st),
    }
    for key in ("eighth", "4x"):
        if key in pairs:
            for fmt in ("pt", "safetensors"):
                path = getattr(pairs[key], fmt)
                commands[f"{key}/{fmt}"] = ckpt_command("inspect", path, "--json")
    return commands


def print_main_table(results: dict[str, Summary], main_pair: GeneratedPair) -> None:
    def row(name: str, base: str | None) -> list[str]:
        s = results[name]
        r = ratio(s.wall_s, results[base].wall_s) if base else ""
        rr = ratio(s.peak_rss_mb, results[base].peak_rss_mb) if base else ""
        return [name, f"{s.wall_s:.3f}", s.spread, f"{s.peak_rss_mb:.1f}", r, rr]

    headers = [
        "command",
        "wall s (median)",
        "min-max",
        "peak RSS MB",
        "wall/inspect",
        "RSS/inspect",
    ]
    print()
    print(f"== {main_pair.label} ({main_pair.pt.stat().st_size / 2**20:.0f} MiB .pt) ==")
    print(fmt_table([row(name, base) for name, base in MAIN_ROWS], headers))
    print("(ratios > 1 mean the baseline is slower / bigger than ckpt inspect)")


def print_scaling_table(
    results: dict[str, Summary], pairs: dict[str, GeneratedPair], repeats: int
) -> None:
    """CLI and in-process inspect time of the main, 1/8-bytes and 4x-tensors files."""
    calls = max(15, repeats)
    print()
    print("== inspect time vs tensor count and bytes ==")
    print(
        "CLI wall = `ckpt inspect FILE --json` (median); in-process = "
        f"ckpt_tools.inspect(FILE) + its JSON, median of {calls} calls in one process "
        "(no interpreter start-up: the per-file work alone, far less noisy)"
    )
    rows = []
    for fmt, base_name in (("pt", PT), ("safetensors", ST)):
        base_ms = None
        for key, name in (("main", base_name), ("eighth", f"eighth/{fmt}"), ("4x", f"4x/{fmt}")):
            s, p = results[name], pairs[key]
            ms = inprocess_ms(getattr(p, fmt), calls)
            base_ms = base_ms if base_ms is not None else ms
            rows.append(
                [
                    f".{fmt} {p.label}",
                    f"{s.wall_s:.3f}",
                    f"{ms:.1f}",
                    ratio(ms, base_ms),
                    f"{s.peak_rss_mb:.1f}",
                ]
            )
    headers = ["file", "CLI wall s", "in-process ms", "in-process / 350 tensors", "peak RSS MB"]
    print(fmt_table(rows, headers))


def inspect_checks(results: dict[str, Summary]) -> list[tuple[bool, str]]:
    """Wall time and peak RSS of ``ckpt inspect`` on each format against the targets."""
    checks = []
    for fmt, name in (("pt", PT), ("safetensors", ST)):
        s = results[name]
        checks.append(
            (s.wall_s <= TARGET_S, verdict(f"inspect .{fmt} wall", s.wall_s, TARGET_S, "s"))
        )
        checks.append(
            (
                s.peak_rss_mb <= TARGET_MB,
                verdict(f"inspect .{fmt} peak RSS", s.peak_rss_mb, TARGET_MB, "MB"),
            )
        )
    return checks


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dropped = drop_caches() if args.cold else None
    print(f"machine: {machine_note()}")
    print(cache_state_note(args.cold, dropped))
    cold = bool(args.cold and dropped)
    print(f"before: {load_note()}")
    with workdir(args.workdir, keep=args.keep) as folder:
        pairs = make_inputs(args, folder)
        commands = inspect_commands(pairs)
        print(f"measuring ({args.repeats} timed runs each after 1 warm-up, interleaved) ...")
        results = interleaved_rounds(commands, args.repeats, before=drop_caches if cold else None)
        print_main_table(results, pairs["main"])
        if not args.no_scaling:
            print_scaling_table(results, pairs, args.repeats)
        print(f"(after measuring: {load_note()})")
        print()
        checks = inspect_checks(results)
        for _, line in checks:
            print(line)
        if args.profile or not all(ok for ok, _ in checks):
            print()
            print(profile_inspect(pairs["main"].pt))
            print()
            print(profile_inspect(pairs["main"].safetensors))
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
