"""The scan corpus is what it claims: every malicious file runs its payload, no benign one does.

The corpus (``tests/helpers/scan_corpus.py``) is built once in a temp folder; ONE fresh
Python (cwd a temp folder) loads every file the way its entry says, so the whole corpus
costs one torch import. Each malicious file must create its own marker, and only its own;
the benign and nonstandard files must load without error and create none.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.scan_corpus import (
    MALICIOUS,
    NUMPY_LOAD,
    PICKLE_LOAD,
    SAFETENSORS_LOAD,
    TORCH_LOAD,
    CorpusEntry,
    build_corpus,
)

# Loads every entry in order; after each malicious one, lists the markers that appeared
# (a Popen'd or shell payload may finish a moment later, so the parent waits for stragglers).
_LOADER = f"""
import json, os, pickle, sys, traceback
entries = json.load(open(sys.argv[1]))
markers = sys.argv[2]
results = []
for e in entries:
    error = None
    try:
        if e["load"] == {TORCH_LOAD!r}:
            import torch
            torch.load(e["path"], weights_only=False)
        elif e["load"] == {PICKLE_LOAD!r}:
            with open(e["path"], "rb") as f:
                pickle.load(f)
        elif e["load"] == {NUMPY_LOAD!r}:
            import numpy
            numpy.load(e["path"], allow_pickle=True)
        elif e["load"] == {SAFETENSORS_LOAD!r}:
            from safetensors.torch import load_file
            load_file(e["path"])
        else:
            raise ValueError("unknown load: " + e["load"])
    except BaseException as exc:
        error = traceback.format_exception_only(type(exc), exc)[-1].strip()
    results.append({{"name": e["name"], "error": error, "markers": sorted(os.listdir(markers))}})
sys.stdout.flush()
print("RESULTS" + json.dumps(results))
"""


def _load_all(entries: list[CorpusEntry], markers: Path, cwd: Path) -> list[dict]:
    listing = cwd / "entries.json"
    listing.write_text(json.dumps([e.to_json() for e in entries if e.live]))
    proc = subprocess.run(
        [sys.executable, "-c", _LOADER, str(listing), str(markers)],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    tail = proc.stdout.rpartition("RESULTS")[2]
    assert proc.returncode == 0 and tail, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(tail)


def _wait_for(paths: list[Path], seconds: float = 10.0) -> list[Path]:
    """The paths still missing after waiting up to ``seconds`` (payloads run in children)."""
    deadline = time.monotonic() + seconds
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.05)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    """(entries, markers folder, results by name): the corpus built, then loaded once."""
    root = tmp_path_factory.mktemp("scan_corpus")
    files, markers, cwd = root / "files", root / "markers", root / "cwd"
    for d in (files, markers, cwd):
        d.mkdir()
    entries = build_corpus(files, markers)
    # Benign files first: the marker folder must still be empty after all of them.
    ordered = [e for e in entries if e.kind != MALICIOUS] + [
        e for e in entries if e.kind == MALICIOUS
    ]
    results = {r["name"]: r for r in _load_all(ordered, markers, cwd)}
    return entries, markers, results


def test_every_malicious_file_is_live_and_no_benign_file_is(loaded) -> None:
    entries, markers, results = loaded
    malicious = [e for e in entries if e.kind == MALICIOUS]
    others = [e for e in entries if e.kind != MALICIOUS]
    assert len(malicious) >= 30 and len(others) >= 10
    assert len({e.path for e in entries}) == len(entries)
    for e in others:
        if e.live:
            assert results[e.name]["error"] is None, (e.name, results[e.name]["error"])
            assert results[e.name]["markers"] == [], e.name
    missing = _wait_for([e.marker for e in malicious if e.marker is not None])
    assert not missing, f"payloads that did not run: {sorted(p.name for p in missing)}"
    # Each marker was made by its own file: it had not appeared before that file was loaded.
    seen: set[str] = set()
    for e in malicious:
        assert e.marker is not None
        assert e.marker.name not in seen, f"{e.name}'s marker appeared before it was loaded"
        seen |= set(results[e.name]["markers"])
    assert sorted(p.name for p in markers.iterdir()) == sorted(
        e.marker.name for e in malicious if e.marker is not None
    )


def test_malicious_files_still_load_as_checkpoints(loaded) -> None:
    """Each payload runs and is discarded: the file then loads on, without an error (but
    where the bytes break after the payload, as the entry says)."""
    entries, _markers, results = loaded
    failed = {e.name: results[e.name]["error"] for e in entries if e.kind == MALICIOUS}
    breaks = {e.name for e in entries if e.breaks}
    assert {name: error for name, error in failed.items() if error is not None} == {
        name: failed[name] for name in breaks
    }
    assert all(failed[name] is not None for name in breaks)
