"""Every committed regression input, through the same invariants as the fuzzer.

Each file under ``regressions/`` runs through ``ct.inspect`` (sandboxed) and the reference
readers, ``ckpt inspect --json``, and the rewrite that showed its bug (the manifest's
``plan``; for files without one, ``strip-module`` and ``convert``). A file listed in
``EXPECTED_FAILURES.json`` is a known open bug and is ``xfail(strict=True)``: when a fix lands
the test passes, strict XPASS fails the run, and the manifest entry must be removed (the file
stays, as a regression test that must pass).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzzkit.campaign import Plan, Session, rewrite_plans
from fuzzkit.registry import REGRESSIONS, Registry, expected, regression_files
from fuzzkit.workers import CLI_TIMEOUT

EXPECTED = expected()
FILES = regression_files()


def _param(path: Path) -> object:
    entry = EXPECTED.get(path.name)
    if entry is None:
        return pytest.param(path, id=path.name)
    reason = f"finding class {entry['class']}: {entry['what']}"
    return pytest.param(path, id=path.name, marks=pytest.mark.xfail(strict=True, reason=reason))


def _plans(path: Path, entry: dict[str, object]) -> list[Plan]:
    plan = entry.get("plan")
    if isinstance(plan, dict):
        return [Plan(**{**plan, "args": tuple(plan.get("args", ()))})]
    if entry:
        return []  # an inspect finding: inspect alone shows it
    chosen = {"strip-module", "convert"}
    return [p for p in rewrite_plans(path.suffix) if p.command in chosen and not p.preexisting]


@pytest.mark.parametrize("path", [_param(p) for p in FILES])
def test_regression_input(path: Path, session: Session) -> None:
    entry = EXPECTED.get(path.name, {})
    data = path.read_bytes()
    mutations = list(entry.get("mutations", []))
    findings = session.check_library(data, path.suffix, mutations)
    if not entry or entry.get("cli") or entry.get("plan"):
        session.cli_timeout = float(entry.get("timeout", CLI_TIMEOUT))  # a known hang
        try:
            findings += session.check_cli(data, path.suffix, mutations, _plans(path, entry))
        finally:
            session.cli_timeout = CLI_TIMEOUT
    if findings and not entry:  # for ``python -m fuzzkit.manifest``
        log = Registry(log_name="regressions.jsonl")
        for f in findings:
            log.log(f, path.name, mutations)
    assert not findings, "\n".join(str(f) for f in findings)


def test_manifest_names_committed_files() -> None:
    """Every manifest entry names a committed file and a finding class (fuzzkit.checks)."""
    names = {p.name for p in FILES}
    scenarios = {k for k in EXPECTED if k.startswith("scenario:")}
    assert set(EXPECTED) - scenarios <= names, set(EXPECTED) - scenarios - names
    for name, entry in EXPECTED.items():
        assert entry["class"] in range(1, 10), name
        assert entry["what"], name
    assert REGRESSIONS.is_dir()
