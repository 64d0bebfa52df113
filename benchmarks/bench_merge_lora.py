"""How ``ckpt merge-lora`` compares with transformers + PEFT's merge, in the same run.

Run:  .venv/bin/python benchmarks/bench_merge_lora.py [--layers 16] [--repeats 2]

Generates, in a temp folder (removed at the end), a Llama-shaped model built from a config
(hidden 1024, MLP 2816, vocab 32000; 16 layers is ~1.1 GB of fp32 weights) saved with
``save_pretrained`` (safetensors, sharded at 500MB), and a LoRA adapter (r=16 on every attention
and MLP projection, B made non-zero) saved by PEFT. Then, as interleaved rounds (theirs, ours,
...), each in a fresh subprocess:

* theirs: ``AutoModelForCausalLM.from_pretrained(BASE)``, ``PeftModel.from_pretrained``,
  ``merge_and_unload()``, ``save_pretrained(OUT)`` (python -c);
* ours:   ``ckpt merge-lora BASE ADAPTER ours.safetensors`` (verifies keys and sizes, fsyncs).

Wall time and peak RSS per command (medians over REPEATS rounds), then the outputs compared
tensor by tensor: how many are bitwise equal, and the largest difference.

Targets: ours peak RSS <= 200 MB, and ours faster than theirs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Measurement,
    ckpt_command,
    fmt_table,
    load_note,
    machine_note,
    measure,
    python_command,
    ratio,
    verdict,
    workdir,
)

_THEIRS = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
merged.save_pretrained(out, max_shard_size="100GB")
"""

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_inputs(folder: Path, layers: int) -> tuple[Path, Path]:
    """The base model folder and the adapter folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder / "base", max_shard_size="500MB")
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=_TARGETS))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    lora.save_pretrained(folder / "adapter")
    return folder / "base", folder / "adapter"


def compare(ours: Path, theirs: Path) -> tuple[int, int, float]:
    """Tensors compared, how many bitwise equal, the largest absolute difference."""
    import torch
    from safetensors.torch import load_file

    a = load_file(ours)
    b = {}
    for shard in sorted(theirs.glob("*.safetensors")):
        b.update(load_file(shard))
    equal, worst = 0, 0.0
    for key, t in b.items():
        if torch.equal(a[key], t):
            equal += 1
        else:
            worst = max(worst, (a[key].double() - t.double()).abs().max().item())
    return len(b), equal, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    print(machine_note(), load_note())
    with workdir(keep=args.keep) as folder:
        base, adapter = make_inputs(folder, args.layers)
        size = sum(p.stat().st_size for p in base.glob("*.safetensors"))
        print(f"base: {size / 2**20:.0f} MiB in {len(list(base.glob('*.safetensors')))} shards")
        runs: dict[str, list[Measurement]] = {"theirs": [], "ours": []}
        for _ in range(args.repeats):
            theirs_out, ours_out = folder / "theirs", folder / "ours.safetensors"
            runs["theirs"].append(measure(python_command(_THEIRS, base, adapter, theirs_out)))
            runs["ours"].append(
                measure(ckpt_command("merge-lora", base, adapter, ours_out, "--force", "-q"))
            )
        rows = []
        for name, ms in runs.items():
            wall = statistics.median(m.wall_s for m in ms)
            rss = statistics.median(m.peak_rss_mb for m in ms)
            rows.append((name, f"{wall:.2f} s", f"{rss:.0f} MB"))
        print(fmt_table(rows, ["command", "wall (median)", "peak RSS (median)"]))
        ours_wall = statistics.median(m.wall_s for m in runs["ours"])
        theirs_wall = statistics.median(m.wall_s for m in runs["theirs"])
        print(f"ours / theirs wall: {ratio(ours_wall, theirs_wall)}")
        count, equal, worst = compare(folder / "ours.safetensors", folder / "theirs")
        print(f"outputs: {count} tensors, {equal} bitwise equal, largest difference {worst:.3g}")
        rss = max(m.peak_rss_mb for m in runs["ours"])
        print(verdict("ours peak RSS", rss, 200, "MB"))
        print(verdict("ours wall", ours_wall, theirs_wall, "s"))


if __name__ == "__main__":
    main()
