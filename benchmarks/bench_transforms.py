"""``ckpt slim`` and ``ckpt average`` against the load-everything scripts people write.

Run:  .venv/bin/python benchmarks/bench_transforms.py [--size-mb 1024] [--avg-mb 256]

Generates, in a temp folder (removed at the end):

* a trainer checkpoint ``{"model", "optimizer" (Adam: exp_avg, exp_avg_sq, step), "epoch"}``
  of about SIZE MiB in all (fp32 weights a third of it), and times
  ``ckpt slim IN OUT --dtype bf16 --weights-only`` against
  ``torch.load`` + ``.to(bfloat16)`` of the weights + ``torch.save``;
* four fp32 state dicts of about AVG MiB each, and times ``ckpt average IN1..IN4 OUT``
  against loading all four and averaging in float64 (``sum(x.double()) / 4``, ``.to(dtype)``);
* two state dicts of 8000 keys that are views of one flat buffer (``zero_to_fp32``'s and FSDP's
  layout), averaged the same ways: the time grows with the keys, not with their square.

Each command runs in a fresh subprocess (wall time and peak RSS of that process); outputs are
fsynced by ckpt itself, and the baselines' outputs are fsynced and the time added.
Targets: peak RSS <= 200 MB for both, and faster than the baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    ckpt_command,
    fmt_table,
    load_note,
    machine_note,
    measure,
    python_command,
    sync_all,
    sync_file,
    workdir,
)

_MAKE = """
import sys, torch
path, size_mb, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(int(sys.argv[4]) if len(sys.argv) > 4 else 0)
weights_mb = size_mb // 3 if kind == "trainer" else size_mb
n = 64
per = weights_mb * (1 << 20) // 4 // n
model = {f"layers.{i}.weight": torch.randn(per // 1024, 1024) for i in range(n)}
model["bn.num_batches_tracked"] = torch.tensor(7)
if kind == "flat":  # every key a view of one buffer
    per = weights_mb * (1 << 20) // 4 // 8000
    flat = torch.randn(per * 8000)
    model = {f"p{j}": flat[j * per : (j + 1) * per] for j in range(8000)}
if kind == "trainer":
    state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(v),
                 "exp_avg_sq": torch.rand_like(v)}
             for i, v in enumerate(t for t in model.values() if t.is_floating_point())}
    groups = [{"lr": 1e-3, "params": list(state)}]
    obj = {"model": model, "optimizer": {"state": state, "param_groups": groups}, "epoch": 3}
else:
    obj = model
torch.save(obj, path)
"""

_SLIM_BASELINE = """
import os, sys, torch
ckpt = torch.load(sys.argv[1], weights_only=True)
sd = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in ckpt["model"].items()}
torch.save(sd, sys.argv[2])
"""

_AVG_BASELINE = """
import sys, torch
sds = [torch.load(p, weights_only=True) for p in sys.argv[2:]]
out = {}
for k, v in sds[0].items():
    if v.is_floating_point():
        acc = sum(sd[k].double() for sd in sds) / len(sds)
        out[k] = acc.to(v.dtype)
    else:
        out[k] = v
torch.save(out, sys.argv[1])
"""


def make_inputs(tmp: Path, size_mb: int, avg_mb: int) -> tuple[Path, list[Path]]:
    """The trainer checkpoint for slim and the four plain ones for average."""
    trainer = tmp / "trainer.pt"
    measure(python_command(_MAKE, trainer, str(size_mb), "trainer"))
    inputs = [tmp / f"ckpt_{i}.pt" for i in range(4)]
    for i, p in enumerate(inputs):
        measure(python_command(_MAKE, p, str(avg_mb), "plain", str(i)))
    for i in range(2):
        measure(python_command(_MAKE, tmp / f"flat_{i}.pt", str(avg_mb), "flat", str(i)))
    sync_all()
    return trainer, inputs


def make_cases(tmp: Path, trainer: Path, inputs: list[Path]) -> list[tuple]:
    """(task, ckpt's command, the baseline's, ckpt's output, the baseline's) per task."""
    flat = [tmp / f"flat_{i}.pt" for i in range(2)]
    return [
        (
            "slim --dtype bf16 --weights-only",
            ckpt_command("slim", trainer, tmp / "a.pt", "--dtype", "bf16", "--weights-only"),
            python_command(_SLIM_BASELINE, trainer, tmp / "b.pt"),
            tmp / "a.pt",
            tmp / "b.pt",
        ),
        (
            "average of 4",
            ckpt_command("average", *inputs, tmp / "avg_a.pt"),
            python_command(_AVG_BASELINE, tmp / "avg_b.pt", *inputs),
            tmp / "avg_a.pt",
            tmp / "avg_b.pt",
        ),
        (
            "average of 2, 8000 views of one buffer",
            ckpt_command("average", *flat, tmp / "flat_a.pt"),
            python_command(_AVG_BASELINE, tmp / "flat_b.pt", *flat),
            tmp / "flat_a.pt",
            tmp / "flat_b.pt",
        ),
    ]


def measure_case(name: str, ours_cmd, base_cmd, ours_out: Path, base_out: Path) -> list[str]:
    """ckpt's command, then the baseline, each with its output's fsync; one table row."""
    ours = measure(ours_cmd)
    ours_sync = sync_file(ours_out)
    base = measure(base_cmd)
    base_sync = sync_file(base_out)
    o_s, b_s = ours.wall_s + ours_sync, base.wall_s + base_sync
    ours_out.unlink()
    base_out.unlink()
    sync_all()
    return [
        name,
        f"{o_s:.2f} s",
        f"{ours.peak_rss_mb:.0f} MB",
        f"{b_s:.2f} s",
        f"{base.peak_rss_mb:.0f} MB",
        f"{b_s / o_s:.2f}x",
        "ok" if ours.peak_rss_mb <= 200 and o_s < b_s else "MISSED",
    ]


HEADERS = [
    "task",
    "ckpt",
    "ckpt RSS",
    "baseline",
    "baseline RSS",
    "speed-up",
    "target (<=200 MB, faster)",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--avg-mb", type=int, default=256)
    args = parser.parse_args()
    with workdir() as tmp:
        trainer, inputs = make_inputs(tmp, args.size_mb, args.avg_mb)
        rows = [measure_case(*case) for case in make_cases(tmp, trainer, inputs)]
    print(machine_note())
    print(load_note())
    print(f"trainer checkpoint {args.size_mb} MiB; average inputs 4 x {args.avg_mb} MiB")
    print(fmt_table(rows, HEADERS))


if __name__ == "__main__":
    main()
