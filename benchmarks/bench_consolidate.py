"""How ``ckpt consolidate`` compares with torch's ``dcp_to_torch_save`` (a DCP folder) and with
DeepSpeed's ``zero_to_fp32.py`` (a ZeRO checkpoint, ``--deepspeed``).

Run:  .venv/bin/python benchmarks/bench_consolidate.py [--size-mb 1024] [--ranks 4] [--repeats 2]
      .venv/bin/python benchmarks/bench_consolidate.py --deepspeed [--stage 3] [--size-mb 1024]

Generates, in a temp folder (removed at the end), a ~SIZE MiB DCP checkpoint saved by
``torch.distributed.checkpoint.save`` from RANKS spawned gloo CPU processes: ~RANKS*4
float32 matrices of a transformer-like model, each a DTensor sharded on dim 0 over the ranks
(FSDP's layout; each rank allocates only its own shards, built with ``DTensor.from_local``,
so generating 1 GB does not need 4 GB), plus ``--dim1-mb`` MiB sharded on dim 1 (tensor
parallel's layout; assembled through the bounded buffer instead of copied in the kernel).

Then, as interleaved rounds (theirs, ours, theirs, ours, ...), each in a fresh subprocess:

* theirs: ``dcp_to_torch_save(DIR, theirs.pt)`` (python -c; imports torch, loads every
  tensor into RAM, then ``torch.save``);
* ours:   ``ckpt consolidate DIR ours.pt`` (the installed console script; copies chunks with
  copy_file_range, re-reads the output to verify keys and sizes, fsyncs, renames).

Each output is fsynced after the command, timed, and added to its total (ours fsyncs its
own), then deleted with ``sync`` (untimed). Wall time and peak RSS (GNU time or os.wait4)
are reported per command; medians over REPEATS rounds after one untimed warm-up round.
Finally the two outputs are compared tensor by tensor (torch.load, mmap) to be equal.

With ``--deepspeed``, the checkpoint is a real DeepSpeed run's (``ckpt_tools.harness.zero.runs``:
RANKS CPU ranks under torchrun, one AdamW step, ``save_checkpoint`` at ZeRO stage STAGE) of a
model with ~SIZE MiB of fp32 weights, half of them frozen (the frozen half lies in the model
states files, the trained half in the optimizer partitions with their AdamW moments). Theirs
is then ``python DIR/zero_to_fp32.py DIR OUT_DIR`` (the script DeepSpeed copies beside the
tags; it writes ``OUT_DIR/pytorch_model.bin``), ours ``ckpt consolidate DIR ours.pt``.

Targets: ours peak RSS <= 150 MB, and ours total < theirs total.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PYTHON,
    Measurement,
    ckpt_command,
    fmt_table,
    load_note,
    machine_note,
    measure,
    python_command,
    ratio,
    synced_run,
    verdict,
    workdir,
)

TARGET_MB = 150.0

THEIRS = (
    "import sys\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
)

GENERATE = r"""
import sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist, torch.multiprocessing as mp

def worker(rank, world, folder, port, sizes, dim1):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for i, (rows, cols) in enumerate(sizes):
        g = torch.Generator().manual_seed(i)
        full_rows = rows * world
        local = torch.randn(rows, cols, generator=g)
        sd[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
            shape=torch.Size([full_rows, cols]), stride=(cols, 1))
    if dim1:
        rows, cols = dim1
        local = torch.randn(rows, cols, generator=torch.Generator().manual_seed(999))
        sd["tp.weight"] = DTensor.from_local(local, mesh, [Shard(1)], run_check=False,
            shape=torch.Size([rows, cols * world]), stride=(cols * world, 1))
    dcp.save({"model": sd}, checkpoint_id=folder)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    folder, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    size_mb, dim1_mb = float(sys.argv[4]), float(sys.argv[5])
    cols = 2048
    per_rank = size_mb * (1 << 20) / 4 / world  # float32 elements per rank
    count = 4 * world
    rows = max(1, int(per_rank / count / cols))
    sizes = [(rows, cols)] * count
    dim1 = (1024, max(1, int(dim1_mb * (1 << 20) / 4 / world / 1024))) if dim1_mb else None
    mp.spawn(worker, args=(world, folder, port, sizes, dim1), nprocs=world)
"""

COMPARE_ZERO = (
    "import sys, torch\n"
    "a = torch.load(sys.argv[1], mmap=True, weights_only=True)\n"
    "b = torch.load(sys.argv[2], mmap=True, weights_only=True)\n"
    "assert list(a) == list(b), (list(a)[:3], list(b)[:3])\n"
    "assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)\n"
    "print(len(a), 'tensors equal')\n"
)

COMPARE = (
    "import sys, torch\n"
    "a = torch.load(sys.argv[1], mmap=True, weights_only=True)\n"
    "b = torch.load(sys.argv[2], mmap=True, weights_only=True)['model']\n"
    "assert list(a) == list(b), (list(a)[:3], list(b)[:3])\n"
    "assert all(torch.equal(a[k], b[k]) for k in a)\n"
    "print(len(a), 'tensors equal')\n"
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _generate_dcp(tmp: Path, args: argparse.Namespace) -> tuple[Path, str]:
    folder = tmp / "dcp"
    script = tmp / "generate.py"
    script.write_text(GENERATE)
    gen = measure(
        [
            PYTHON,
            str(script),
            str(folder),
            str(args.ranks),
            str(_free_port()),
            str(args.size_mb - args.dim1_mb),
            str(args.dim1_mb),
        ]
    )
    size = sum(p.stat().st_size for p in folder.iterdir())
    files = len(list(folder.glob("*.distcp")))
    return folder, (
        f"DCP checkpoint: {size / (1 << 20):.0f} MiB in {files} .distcp files from "
        f"{args.ranks} spawned ranks ({gen.wall_s:.0f} s to save)"
    )


def _generate_zero(tmp: Path, args: argparse.Namespace) -> tuple[Path, str]:
    import time

    from ckpt_tools.harness.zero.launch import make_zero_checkpoints
    from ckpt_tools.harness.zero.runs import ZeroRun

    # ZeroNet holds about 4 * width**2 parameters, half of them frozen.
    width = max(8, int(math.sqrt(args.size_mb * (1 << 20) / 4 / 4)))
    started = time.perf_counter()
    run = ZeroRun("zero", stage=args.stage, steps=1, width=width)
    folder = make_zero_checkpoints(tmp, [run], world_size=args.ranks, timeout=3600)["zero"]
    seconds = time.perf_counter() - started
    tag = (folder / "latest").read_text()
    size = sum(p.stat().st_size for p in (folder / tag).iterdir())
    return folder, (
        f"DeepSpeed ZeRO-{args.stage} checkpoint (width {width}): {size / (1 << 20):.0f} MiB "
        f"in {tag}/ (weights and AdamW moments) from {args.ranks} torchrun ranks "
        f"({seconds:.0f} s to train and save)"
    )


def _commands(folder: Path, tmp: Path, deepspeed: bool) -> list[tuple[str, list[str], Path]]:
    """(name, command, output) of theirs, then ours."""
    ours = tmp / "ours.pt"
    if deepspeed:
        out = tmp / "theirs"
        theirs_cmd = [PYTHON, str(folder / "zero_to_fp32.py"), str(folder), str(out)]
        return [
            ("zero_to_fp32.py", theirs_cmd, out / "pytorch_model.bin"),
            ("ckpt consolidate", ckpt_command("consolidate", folder, ours), ours),
        ]
    theirs = tmp / "theirs.pt"
    return [
        ("dcp_to_torch_save", python_command(THEIRS, folder, theirs), theirs),
        ("ckpt consolidate", ckpt_command("consolidate", folder, ours), ours),
    ]


def _rounds(commands: list[tuple[str, list[str], Path]], repeats: int) -> dict[str, list[Any]]:
    """Interleaved rounds of every command; round 0 warms the page cache and is not kept."""
    runs: dict[str, list[Measurement]] = {name: [] for name, _, _ in commands}
    for i in range(repeats + 1):
        for name, cmd, out in commands:
            # The last round's outputs stay, for the comparison after the timing.
            m = synced_run(cmd, out, remove=i < repeats)
            if i:
                runs[name].append(m)
    return runs


def _report(runs: dict[str, list[Any]], equal: bool) -> bool:
    """Print the table and the verdicts; whether every target was met."""
    rows = []
    for name, ms in runs.items():
        rows.append(
            [
                name,
                f"{statistics.median(m.wall_s for m in ms):.2f}",
                f"{statistics.median(m.total_s for m in ms):.2f}",
                f"{max(m.peak_rss_mb for m in ms):.0f}",
            ]
        )
    print(fmt_table(rows, ["command", "wall s", "total s (+fsync)", "peak RSS MB"]))
    theirs_name = next(n for n in runs if n != "ckpt consolidate")
    t = statistics.median(m.total_s for m in runs[theirs_name])
    o = statistics.median(m.total_s for m in runs["ckpt consolidate"])
    rss = max(m.peak_rss_mb for m in runs["ckpt consolidate"])
    print(f"ours / theirs total time: {ratio(o, t)}; outputs equal: {equal}")
    print(verdict("ckpt consolidate peak RSS", rss, TARGET_MB, "MB"))
    print(verdict(f"ckpt consolidate / {theirs_name} time", o / t, 1.0, "x"))
    print(machine_note())
    print(load_note())
    return rss <= TARGET_MB and o < t and equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dim1-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--deepspeed", action="store_true", help="a DeepSpeed ZeRO checkpoint")
    parser.add_argument("--stage", type=int, default=3, help="the ZeRO stage (--deepspeed)")
    parser.add_argument("--dir", default=None, help="parent folder for the temp files")
    args = parser.parse_args()
    with workdir(args.dir) as tmp:
        generate = _generate_zero if args.deepspeed else _generate_dcp
        folder, what = generate(tmp, args)
        print(what)
        commands = _commands(folder, tmp, args.deepspeed)
        runs = _rounds(commands, args.repeats)
        (_, _, theirs), (_, _, ours) = commands
        code = COMPARE_ZERO if args.deepspeed else COMPARE
        check = measure([PYTHON, "-c", code, str(ours), str(theirs)], stdout=None)
        ok = _report(runs, check.returncode == 0)
        os.sync()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
