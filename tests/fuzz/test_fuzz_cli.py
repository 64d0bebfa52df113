"""Mutated checkpoints through the real ``ckpt`` command (inspect and rewrites).

Each input runs ``python -m ckpt_tools inspect --json`` and one rewrite (strip-module,
add-module, rename, convert, retag; sometimes over an existing OUT, with or without
``--force``) as bounded subprocesses. After each run: exit code in {0,2,3,4,5,6,7}, one stderr
line and no traceback on failure, nothing executed, the input unchanged, no temp file left, no
output (or the old output intact) on failure; after a successful rewrite the output loads with
``torch.load(weights_only=True)`` and ``mmap=True`` (or safetensors) in this process and holds
what the reference reader saw in the input.
"""

from __future__ import annotations

from fuzzkit import mutators, seeds
from fuzzkit.budget import fuzz
from fuzzkit.campaign import Session, draw_plan
from fuzzkit.draw import Draw
from fuzzkit.registry import Registry, assert_no_new
from hypothesis import strategies as st

SEEDS = seeds.all_seeds()


def test_fuzz_cli(session: Session, registry: Registry) -> None:
    tried = []

    def run(data: st.DataObject) -> None:
        d = Draw(data)
        seed = d.choice(SEEDS)
        count = d.choice((0, 1, 1, 2))
        mutated, names = mutators.mutate(seed, d, count) if count else (seed.data, [])
        plan = draw_plan(d, seed.ext)
        pristine = not count and not seed.name.startswith("fixture-")
        findings = session.check_cli(mutated, seed.ext, names, [plan], pristine=pristine)
        registry.report(findings, mutated, seed.ext, names)
        tried.append(plan.label())

    fuzz("CKPT_FUZZ_CLI_EXAMPLES", 12, share=0.3, rounds_of=3, body=run)
    print(f"\ncli fuzz: {len(tried)} inputs; {dict(session.stats)}")
    print(registry.summary())
    assert_no_new(registry)
