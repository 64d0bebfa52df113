"""How fast ``load_state_dict`` and ``load_into`` are, and what memory they take, beside torch.

Run:  nice .venv/bin/python benchmarks/bench_load.py [--size-mb 1024] [--repeats 3]

Generates, in a temp folder (removed at the end), a ~SIZE MiB ``.pt`` and ``.safetensors`` with
~350 float32 tensors (DataParallel keys, ``common.make_checkpoints``), then measures, each in
a fresh subprocess, interleaved round-robin, median of REPEATS runs after one warm-up run:

* ``ckpt_tools.load_state_dict(FILE, mmap=True)`` (our reader, records memory-mapped, as
  torch.load's beside it) for both files;
* .pt: ``torch.load(FILE, mmap=True, weights_only=True)``;
* .safetensors: ``safetensors.torch.load_file(FILE)``;
* ``ckpt_tools.load_into(model, FILE, mmap=True)`` of a model built under
  ``torch.device("meta")`` (the tensors are assigned: ``load_state_dict(..., assign=True)``,
  and, mapped, stay backed by the file).

Each child reports, around the load call only (after ``import torch``, so the interpreter
and torch import are not counted): the call's wall time, then a pass reading every tensor
once (``t.sum()``: the page faults the mapping defers), and ``RssAnon`` (anonymous resident
memory, from /proc/self/status) before and after. The parent also records each child's
whole wall time and peak RSS (which counts the mapped file pages a process touched).

Targets: ``load_state_dict`` of the .pt within 1.2x of ``torch.load(mmap=True)`` (load call
time); ``load_into`` of the meta-device model grows anonymous RSS by less than 15% of the file
size (both formats). Exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MIB,
    fmt_table,
    load_note,
    machine_note,
    make_checkpoints,
    measure,
    python_command,
    ratio,
    verdict,
    workdir,
)

# The child: KIND FILE REPORT. Imports first, then the timed load, then a timed read of every
# tensor; writes a JSON report.
CHILD = r"""
import json, sys, time

def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0

kind, path, report = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
if kind in ("ckpt", "meta"):
    from ckpt_tools import load_into, load_state_dict
if kind == "st":
    from safetensors.torch import load_file
model = None
if kind == "meta":
    from ckpt_tools.formats import open_checkpoint
    from ckpt_tools.structure.tensor_walk import iter_tensors

    def build(shapes):
        root = torch.nn.Module()
        for key, shape in shapes:
            parts = key.split(".")
            if parts[0] == "module":  # the model is the plain one; load_into strips module.
                parts = parts[1:]
            node = root
            for part in parts[:-1]:
                if not hasattr(node, part):
                    node.add_module(part, torch.nn.Module())
                node = getattr(node, part)
            node.register_parameter(parts[-1], torch.nn.Parameter(torch.empty(shape)))
        return root

    shapes = [(k, ref.shape) for k, ref in iter_tensors(open_checkpoint(path).root)]
    with torch.device("meta"):
        model = build(shapes)

def load(model):
    if kind == "ckpt":
        return load_state_dict(path, mmap=True)
    if kind == "torch":
        return torch.load(path, mmap=True, weights_only=True)
    if kind == "st":
        return load_file(path)
    result = load_into(model, path, mmap=True)
    assert result.assigned and result.ok, result
    return model.state_dict()

anon0 = rss_anon()
start = time.perf_counter()
sd = load(model)
load_s = time.perf_counter() - start
anon1 = rss_anon()
# Again, in the same process: the first call also imports what the loader imports lazily
# (for ckpt_tools: the zip reader, unpickler and allowlist modules; torch.load's are part of
# import torch). load_into needs a fresh meta model, built before the clock starts.
model2 = None
if kind == "meta":
    with torch.device("meta"):
        model2 = build(shapes)
start = time.perf_counter()
again = load(model2)
load2_s = time.perf_counter() - start
del again, model2
start = time.perf_counter()
total = 0.0
for t in sd.values():
    total += float(t.sum())
touch_s = time.perf_counter() - start
anon2 = rss_anon()
with open(report, "w") as f:
    json.dump({"load_s": load_s, "load2_s": load2_s, "touch_s": touch_s, "anon_load": anon1 - anon0,
               "anon_touch": anon2 - anon0, "tensors": len(sd), "sum": total}, f)
"""


def _run(kind: str, path: Path, folder: Path) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", dir=folder) as report:
        m = measure(python_command(CHILD, kind, path, report.name))
        data = json.load(open(report.name))  # noqa: SIM115 (the temp file closes it)
    data["wall_s"], data["peak_mb"] = m.wall_s, m.peak_rss_mb
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--tensors", type=int, default=350)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    return parser.parse_args(argv)


def run_cases(cases: dict[str, tuple[str, Path]], repeats: int, folder: Path) -> dict[str, list]:
    """One warm-up round, then ``repeats`` rounds of every case; the timed runs' reports."""
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    for i in range(1 + repeats):
        for name, (kind, path) in cases.items():
            data = _run(kind, path, folder)
            if i:
                runs[name].append(data)
    return runs


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per case, the median of each reading; the worst peak RSS and anonymous growth."""
    med = {
        name: {key: statistics.median(d[key] for d in rs) for key in rs[0] if key != "sum"}
        for name, rs in runs.items()
    }
    for name, rs in runs.items():
        med[name]["peak_mb"] = max(d["peak_mb"] for d in rs)
        med[name]["anon_load"] = max(d["anon_load"] for d in rs)
    return med


def print_table(med: dict[str, dict[str, float]]) -> None:
    rows = [
        [
            name,
            f"{m['load_s']:.3f}",
            f"{m['load2_s']:.3f}",
            f"{m['touch_s']:.3f}",
            f"{m['wall_s']:.2f}",
            f"{m['peak_mb']:.0f}",
            f"{m['anon_load'] / MIB:.1f}",
            f"{m['anon_touch'] / MIB:.1f}",
        ]
        for name, m in med.items()
    ]
    headers = ["case", "load s", "2nd load s", "read-all s", "process s", "peak MB", "anon MB"]
    headers.append("anon+read MB")
    print(fmt_table(rows, headers))


def print_ratios(med: dict[str, dict[str, float]]) -> None:
    """load_state_dict against torch.load (first and second call) and safetensors."""
    ours, torch_s = med["pt load_state_dict"], med["pt torch.load(mmap=True)"]
    print(
        "load_state_dict / torch.load(mmap=True): "
        f"{ratio(ours['load_s'], torch_s['load_s'])} (first call)"
    )
    print(
        "load_state_dict / torch.load(mmap=True): "
        f"{ratio(ours['load2_s'], torch_s['load2_s'])} (second call)"
    )
    st_ours, st_base = med["st load_state_dict"], med["st safetensors load_file"]
    print(
        "load_state_dict / safetensors load_file: "
        f"{ratio(st_ours['load_s'], st_base['load_s'])} (load call)"
    )


def checks(med: dict[str, dict[str, float]], size: dict[str, int], same: bool) -> list[str]:
    """The PASS/FAIL lines."""
    ours, torch_s = med["pt load_state_dict"]["load_s"], med["pt torch.load(mmap=True)"]["load_s"]
    return [
        verdict("pt load_state_dict vs torch.load(mmap=True)", ours / torch_s, 1.2, "x"),
        verdict(
            "pt load_into(meta) anonymous RSS growth",
            100 * med["pt load_into(meta)"]["anon_load"] / size["pt"],
            15,
            "% of file",
        ),
        verdict(
            "st load_into(meta) anonymous RSS growth",
            100 * med["st load_into(meta)"]["anon_load"] / size["st"],
            15,
            "% of file",
        ),
        verdict("every .pt case read the same values", 0, 0, "", ok=same),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(machine_note())
    print(load_note())
    with workdir(args.workdir, args.keep) as folder:
        pair = make_checkpoints(folder, args.size_mb, args.tensors)
        size = {"pt": pair.pt.stat().st_size, "st": pair.safetensors.stat().st_size}
        print(f"inputs: {pair.label}; .pt {size['pt'] / MIB:.0f} MiB (page cache warm)")
        cases = {
            "pt load_state_dict": ("ckpt", pair.pt),
            "pt torch.load(mmap=True)": ("torch", pair.pt),
            "pt load_into(meta)": ("meta", pair.pt),
            "st load_state_dict": ("ckpt", pair.safetensors),
            "st safetensors load_file": ("st", pair.safetensors),
            "st load_into(meta)": ("meta", pair.safetensors),
        }
        runs = run_cases(cases, args.repeats, folder)
        sums = {name: {d["sum"] for d in rs} for name, rs in runs.items()}
        same = len({s for name, ss in sums.items() if name.startswith("pt") for s in ss}) == 1
    med = medians(runs)
    print_table(med)
    print_ratios(med)
    lines = checks(med, size, same)
    print("\n".join(lines))
    return 0 if all(c.startswith("PASS") for c in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
