"""Mutated checkpoints through ``ct.inspect`` (sandboxed) and the reference readers.

Every input is checked for the process-level promises (a CheckpointError or an answer, never
another exception; one-line messages; bounded time and memory; nothing executed; the input
unchanged) and against the differential oracle: what torch.load(weights_only=True) (or
safetensors, or a restricted pickle) reads must be what inspect reports, and what they refuse
we refuse or name the global.
"""

from __future__ import annotations

import pytest
from fuzzkit import mutators, seeds
from fuzzkit.budget import fuzz
from fuzzkit.campaign import Session
from fuzzkit.draw import Draw
from fuzzkit.registry import Registry, assert_no_new
from hypothesis import strategies as st

SEEDS = seeds.all_seeds()


@pytest.mark.parametrize("seed", SEEDS, ids=[s.name for s in SEEDS])
def test_seed_matches_the_references(
    seed: seeds.Seed, session: Session, registry: Registry
) -> None:
    """Every unmutated seed and fixture: inspect agrees with torch / safetensors."""
    pristine = not seed.name.startswith("fixture-")
    findings = session.check_library(seed.data, seed.ext, [], pristine=pristine)
    registry.report(findings, seed.data, seed.ext, [])
    assert_no_new(registry)


def test_fuzz_library(session: Session, registry: Registry) -> None:
    tried = []

    def run(data: st.DataObject) -> None:
        d = Draw(data)
        seed = d.choice(SEEDS)
        mutated, names = mutators.mutate(seed, d, d.choice((1, 1, 1, 2, 3)))
        findings = session.check_library(mutated, seed.ext, names)
        registry.report(findings, mutated, seed.ext, names)
        tried.append(seed.name)

    fuzz("CKPT_FUZZ_EXAMPLES", 300, share=0.7, rounds_of=25, body=run)
    print(f"\nlibrary fuzz: {len(tried)} inputs; {dict(session.stats)}")
    print(registry.summary())
    assert_no_new(registry)
