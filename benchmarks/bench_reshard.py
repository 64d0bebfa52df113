"""How ``ckpt reshard HF_DIR OUT_DIR`` compares with ``cp -r`` and with the naive safetensors way.

Run:  .venv/bin/python benchmarks/bench_reshard.py [--size-mb 1024] [--repeats 5]

Generates, in a temp folder (removed at the end), a ~SIZE MiB ``.safetensors`` with ~350
float32 tensors, converts it (untimed) into a Hugging Face folder of 5 shards with
``ckpt convert``, then measures interleaved rounds (one untimed warm-up round first; medians
reported) of:

* ``cp -r IN OUT``                                   (coreutils);
* ``ckpt reshard IN OUT --max-shard-size S --quiet`` (the console script: plans the new
  shards from the headers, copies tensor bytes with copy_file_range into one temp file per
  shard in a temp folder, verifies each, renames the folder into place);
* the same with ``--jobs J`` (shards written by J threads);
* naive: ``safetensors.torch.load_file`` of every shard into one dict, the same greedy split,
  ``save_file`` per shard and ``json.dump`` of the index (what a script built on
  ``huggingface_hub.save_torch_state_dict`` does: the whole model in memory).

The new shard size is a third of the old one, so every output shard differs from the input.
Writeback is charged fairly: each command's output files are fsynced (timed, added to
"total"), then the folder is deleted and ``sync`` runs (untimed).

Targets: reshard total <= 1.5x ``cp -r`` total, and peak RSS <= 150 MB (the naive way grows
with the model).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PYTHON,
    SYNCED_HEADERS,
    GeneratedPair,
    Summary,
    ckpt_command,
    ckpt_json,
    fmt_table,
    interleaved_rounds,
    load_note,
    machine_note,
    make_checkpoints,
    ratio,
    sync_all,
    synced_cells,
    synced_run,
    verdict,
    workdir,
)

TARGET_RATIO = 1.5
TARGET_MB = 150.0

NAIVE = (
    "import json, os, sys\n"
    "from safetensors.torch import load_file, save_file\n"
    "src, dst, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
    "index = json.load(open(os.path.join(src, 'model.safetensors.index.json')))\n"
    "sd = {}\n"
    "for shard in dict.fromkeys(index['weight_map'].values()):\n"
    "    sd.update(load_file(os.path.join(src, shard)))\n"
    "shards, cur, size = [], {}, 0\n"
    "for k, v in sd.items():\n"
    "    n = v.numel() * v.element_size()\n"
    "    if cur and size + n > limit:\n"
    "        shards.append(cur); cur, size = {}, 0\n"
    "    cur[k] = v; size += n\n"
    "shards.append(cur)\n"
    "os.mkdir(dst)\n"
    "wm = {}\n"
    "for i, part in enumerate(shards):\n"
    "    name = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'\n"
    "    save_file(part, os.path.join(dst, name), metadata={'format': 'pt'})\n"
    "    wm.update({k: name for k in part})\n"
    "total = sum(v.numel() * v.element_size() for v in sd.values())\n"
    "json.dump({'metadata': {'total_size': total}, 'weight_map': wm},\n"
    "          open(os.path.join(dst, 'model.safetensors.index.json'), 'w'), indent=2)\n"
)


def check_output(src: Path, folder: Path, limit: int) -> str:
    """One untimed reshard whose output is loaded with safetensors and compared to the input."""
    out = folder / "check_out"
    result = ckpt_json("reshard", src, out, "--max-shard-size", str(limit))
    code = (
        "import sys, glob, torch\nfrom safetensors.torch import load_file\n"
        "def union(d):\n    out = {}\n"
        "    for f in sorted(glob.glob(d + '/*.safetensors')): out.update(load_file(f))\n"
        "    return out\n"
        "a, b = union(sys.argv[1]), union(sys.argv[2])\n"
        "assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)\n"
        "print(len(a))\n"
    )
    loaded = subprocess.run(
        [PYTHON, "-c", code, str(src), str(out)], capture_output=True, text=True, check=True
    ).stdout.strip()
    shutil.rmtree(out)
    sync_all()
    return (
        f"check: {len(result['written']) - 1} shards, {result['verification']}; "
        f"the union loads with safetensors and equals the input ({loaded} tensors)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="checkpoint size (MiB)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors in the checkpoint")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    ap.add_argument("--no-naive", action="store_true", help="skip the load_file baseline")
    ap.add_argument("--jobs", type=int, default=4, help="--jobs of the second reshard row")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    return ap.parse_args(argv)


def make_input(args: argparse.Namespace, folder: Path) -> tuple[GeneratedPair, Path, int]:
    """A checkpoint in 5 shards (folder ``hf``); returns it, the folder and the new limit."""
    print(f"generating a checkpoint in {folder} ...", flush=True)
    pair = make_checkpoints(folder, args.size_mb, args.tensors, formats=("safetensors",))
    old_limit = pair.nbytes // 5 + 1
    src = folder / "hf"
    subprocess.run(
        ckpt_command("convert", pair.safetensors, src, "--max-shard-size", str(old_limit)),
        check=True,
        capture_output=True,
    )
    pair.safetensors.unlink()
    sync_all()
    return pair, src, old_limit // 3


def reshard_commands(
    args: argparse.Namespace, src: Path, out: Path, limit: int
) -> dict[str, list[str]]:
    """``cp -r``, reshard, reshard with ``--jobs``, and (unless ``--no-naive``) the naive way."""
    reshard = ("reshard", src, out, "--max-shard-size", str(limit), "--quiet")
    commands = {
        "cp -r IN OUT": ["cp", "-r", str(src), str(out)],
        "ckpt reshard IN OUT --quiet": ckpt_command(*reshard),
        f"ckpt reshard ... --jobs {args.jobs}": ckpt_command(*reshard, "--jobs", str(args.jobs)),
    }
    if not args.no_naive:
        commands["naive load_file all + save_file"] = [
            PYTHON, "-c", NAIVE, str(src), str(out), str(limit)
        ]  # fmt: skip
    return commands


def report(results: dict[str, Summary], size_mib: float) -> bool:
    """Print the table and the PASS/FAIL lines; True when both targets pass."""
    cp = results["cp -r IN OUT"]
    rows = [
        [
            name,
            *synced_cells(s),
            f"{size_mib / s.total_s:.0f}",
            f"{s.peak_rss_mb:.1f}",
            ratio(s.total_s, cp.total_s),
        ]
        for name, s in results.items()
    ]
    headers = ["command", *SYNCED_HEADERS, "MiB/s", "peak RSS MB", "total / cp -r"]
    print(fmt_table(rows, headers))
    ours = results["ckpt reshard IN OUT --quiet"]
    ok_time = ours.total_s <= TARGET_RATIO * cp.total_s
    ok_rss = ours.peak_rss_mb <= TARGET_MB
    print(verdict("reshard total / cp -r", ours.total_s / cp.total_s, TARGET_RATIO, "x"))
    print(verdict("reshard peak RSS", ours.peak_rss_mb, TARGET_MB, " MB"))
    return ok_time and ok_rss


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"machine: {machine_note()}")
    print(f"before: {load_note()}")
    with workdir(args.workdir, keep=args.keep) as folder:
        pair, src, limit = make_input(args, folder)
        print(f"== {pair.label} in {len(list(src.glob('*.safetensors')))} shards ==")
        print(check_output(src, folder, limit))
        out = folder / "out"
        commands = reshard_commands(args, src, out, limit)
        print(f"measuring: 1 warm-up round + {args.repeats} timed rounds, interleaved ...")
        results = interleaved_rounds(commands, args.repeats, lambda cmd: synced_run(cmd, out))
        ok = report(results, pair.nbytes / 2**20)
    print(f"after: {load_note()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
