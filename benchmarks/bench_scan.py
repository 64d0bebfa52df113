"""``ckpt scan`` beside picklescan, modelscan, fickling and modelaudit, on live payloads.

The corpus (``tests/helpers/scan_corpus.py``; ``tests/test_scan_corpus.py`` proves every
malicious file in it runs its payload under the load its entry names) is built in a temp
folder, with copies of ``fixtures/*.pt`` and of the real checkpoints under
``../shared/realckpt`` (relative to the repository root) when that folder exists. Nothing
here loads a corpus file: every tool only reads it, and the markers folder the payloads
would write into is checked to be still empty at the end.

Each tool runs once per file (a child process, timed with :func:`common.measure`), and
once on the whole corpus folder where it takes folders (fickling does not: its corpus time
is the sum of its per-file runs). Groups: ``malicious`` (the corpus's live payloads and
``fixtures/evil.pt``), ``benign`` and ``nonstandard`` (the corpus's), ``fixtures`` (the
other ``fixtures/*.pt``, corrupt ones included) and ``real``.

How each tool's verdict per file is read (F flagged, . clean, E error, S skipped):

* ``ckpt scan FILE --json``: F when the JSON verdict is ``dangerous`` (exit 1); E when
  ``unreadable`` (exit 4) or the output is not JSON; else clean (``nonstandard`` is shown in
  the per-file table as ``n``, and counts as clean).
* ``picklescan --path FILE``: F on exit 1 (a dangerous global found), E on exit 2 (scan
  error), S when its summary says ``Scanned files: 0``. The ``picklescan --strict`` row runs
  it again with ``--strict``, which promotes its "suspicious" globals to dangerous.
* ``modelscan -p FILE -r json -o OUT``: F when the JSON report counts any issue (any
  severity; it can exit 2 with an issue found, when another of its scanners failed on the
  same file), else E when the report lists errors or the exit is neither 0 nor 3, S on exit
  3 (no supported file).
* ``fickling --check-safety --json-output OUT FILE`` (its CLI): F on exit 1 (unsafe), E on
  exit 2 (it cannot parse the file: this is what it does with every torch zip).
* ``fickling-api``: what fickling's own Hugging Face mode does for one file, through its
  Python API: ``scan_zip_archive`` for a zip or a ``.pt``/``.pth`` name (it scans the members
  named ``.pkl``/``.pickle``/``.bin``), ``scan_file`` for a pickle (first byte PROTO) or a
  ``.bin``/``.pkl``/``.pickle`` name, S for the rest (its own dispatch,
  ``fickling.polyglot.find_file_properties``, needs torch, which the scanners' venv does not
  hold); F when a result is not ``is_safe`` (worse than LIKELY_SAFE), E when one has
  errors. The ``fickling-api-overt`` row reads the same runs, F only at
  ``LIKELY_OVERTLY_MALICIOUS`` or ``OVERTLY_MALICIOUS``.
* ``modelaudit scan --format json --no-cache FILE`` (with ``CI=1``: no telemetry, no
  progress): F when an issue has severity ``critical``; E on exit 2. The ``modelaudit-exit``
  row reads the same runs by exit code (1: "security issues found", which includes
  warnings such as a non-allowlisted global).

The scanners go in a venv of their own, never ckpt_tools' (``python3 -m venv /tmp/scanners &&
/tmp/scanners/bin/pip install picklescan modelscan fickling modelaudit``); the script finds
them by ``--scanners-venv`` or on PATH, and leaves out (with a note) any it cannot find.

Run: ``.venv/bin/python benchmarks/bench_scan.py --scanners-venv /tmp/scanners``
(``--tools ckpt,picklescan`` to pick tools, ``--no-fixtures``, ``--no-real``, ``--repeats N``
for the whole-corpus runs, ``--keep`` to keep the corpus, ``--details`` for the per-file
table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    REPO,
    ckpt_command,
    fmt_table,
    load_note,
    machine_note,
    measure,
    ratio,
    workdir,
)

FLAGGED, CLEAN, ERROR, SKIPPED, NONSTANDARD_MARK = "F", ".", "E", "S", "n"
GROUPS = ("malicious", "benign", "nonstandard", "fixtures", "real")
REAL_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar", ".pkl", ".safetensors", ".npy")
SCANNER_ENV = {"CI": "1", "PROMPTFOO_DISABLE_TELEMETRY": "1", "NO_COLOR": "1"}

# fickling's Hugging Face dispatch, for one local file (see the module docstring).
FICKLING_API = r"""
import json, sys, zipfile
from pathlib import PurePosixPath
from fickling.loader import scan_file, scan_zip_archive
path = sys.argv[1]
ext = PurePosixPath(path).suffix.lower()
with open(path, "rb") as f:
    head = f.read(2)
if zipfile.is_zipfile(path) or ext in (".pt", ".pth"):
    results = list(scan_zip_archive(path, graceful=True).values())
elif head[:1] == b"\x80" or ext in (".bin", ".pkl", ".pickle"):
    results = [scan_file(path, graceful=True)]
else:
    print(json.dumps({"skipped": True}))
    sys.exit(0)
unsafe = [r.severity.name for r in results if not r.is_safe]
errors = [e for r in results for e in r.errors]
print(json.dumps({"unsafe": unsafe, "errors": errors, "members": len(results)}))
"""


@dataclass(frozen=True)
class Item:
    path: Path
    group: str
    name: str
    shape: str


@dataclass
class Run:
    """One tool run on one file: what the verdict is read from."""

    returncode: int
    stdout: str
    report: str  # the JSON report file some tools write ("" when none)
    wall_s: float


@dataclass
class Tool:
    name: str
    version: str
    argv: Callable[[Path, Path], list[str]]  # (target, report file) -> command
    readings: dict[str, Callable[[Run], str]]  # row label -> verdict of a run
    takes_folders: bool = True
    env: dict[str, str] = field(default_factory=dict)
    runs: dict[Path, Run] = field(default_factory=dict)
    corpus_s: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- verdicts


def ckpt_verdict(run: Run) -> str:
    try:
        verdict = json.loads(run.stdout)["verdict"]
    except (ValueError, KeyError, TypeError):
        return ERROR
    return {"dangerous": FLAGGED, "nonstandard": NONSTANDARD_MARK, "clean": CLEAN}.get(
        verdict, ERROR
    )


def picklescan_verdict(run: Run) -> str:
    if run.returncode == 1:
        return FLAGGED
    if run.returncode != 0:
        return ERROR
    return SKIPPED if re.search(r"Scanned files: 0\b", run.stdout) else CLEAN


def by_exit(run: Run, skipped: int | None = None) -> str:
    if run.returncode == 1:
        return FLAGGED
    if skipped is not None and run.returncode == skipped:
        return SKIPPED
    return CLEAN if run.returncode == 0 else ERROR


def fickling_api_verdict(run: Run) -> str:
    try:
        out = json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return ERROR
    if out.get("skipped"):
        return SKIPPED
    return FLAGGED if out["unsafe"] else ERROR if out["errors"] else CLEAN


def fickling_api_overt(run: Run) -> str:
    """Flagged only at fickling's top severities (overtly malicious, likely or certainly)."""
    verdict = fickling_api_verdict(run)
    if verdict != FLAGGED:
        return verdict
    overt = {"LIKELY_OVERTLY_MALICIOUS", "OVERTLY_MALICIOUS"}
    return (
        FLAGGED if overt & set(json.loads(run.stdout.strip().splitlines()[-1])["unsafe"]) else CLEAN
    )


def modelscan_verdict(run: Run) -> str:
    try:
        report = json.loads(run.report)
    except ValueError:
        return ERROR
    if report.get("summary", {}).get("total_issues", 0):
        return FLAGGED
    if report.get("errors") or run.returncode not in (0, 3):
        return ERROR
    return SKIPPED if run.returncode == 3 else CLEAN


def modelaudit_critical(run: Run) -> str:
    try:
        issues = json.loads(run.stdout).get("issues", [])
    except ValueError:
        return ERROR
    if any(str(i.get("severity", "")).lower() == "critical" for i in issues):
        return FLAGGED
    return ERROR if run.returncode not in (0, 1) else CLEAN


# --------------------------------------------------------------------------- tools


def find_script(name: str, venv: Path | None) -> Path | None:
    if venv is not None and (venv / "bin" / name).exists():
        return venv / "bin" / name
    found = shutil.which(name)
    return Path(found) if found else None


def script_python(script: Path) -> str:
    """The interpreter a console script runs in (its ``#!`` line)."""
    first = script.read_text(errors="replace").splitlines()[0]
    return first[2:].strip() if first.startswith("#!") else sys.executable


def dist_version(python: str, dist: str) -> str:
    proc = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or "?"


def ckpt_tool() -> Tool | None:
    probe = subprocess.run(ckpt_command("scan", "--help"), capture_output=True, text=True)
    if probe.returncode != 0:
        print("ckpt scan: not available in this checkout (ckpt scan --help failed); skipped")
        return None
    version = subprocess.run(ckpt_command("--version"), capture_output=True, text=True)
    return Tool(
        "ckpt scan",
        version.stdout.strip().split()[-1] if version.stdout.strip() else "?",
        lambda target, _report: ckpt_command("scan", target, "--json"),
        {"ckpt scan": ckpt_verdict},
    )


def scanner_tools(venv: Path | None, wanted: Sequence[str]) -> list[Tool]:
    tools: list[Tool] = []
    specs: dict[str, tuple[str, str]] = {
        "picklescan": ("picklescan", "picklescan"),
        "modelscan": ("modelscan", "modelscan"),
        "fickling": ("fickling", "fickling"),
        "modelaudit": ("modelaudit", "modelaudit"),
    }
    for name, (script_name, dist) in specs.items():
        if name not in wanted:
            continue
        script = find_script(script_name, venv)
        if script is None:
            print(f"{name}: not found (in --scanners-venv or on PATH); skipped")
            continue
        python = script_python(script)
        version = dist_version(python, dist)
        s = str(script)
        if name == "picklescan":
            for label, extra in ((name, []), (f"{name} --strict", ["--strict"])):
                tools.append(
                    Tool(
                        label,
                        version,
                        lambda t, _r, s=s, extra=extra: [s, "--path", str(t), *extra],
                        {label: picklescan_verdict},
                        env=SCANNER_ENV,
                    )
                )
        elif name == "modelscan":
            tools.append(
                Tool(
                    name,
                    version,
                    lambda t, r, s=s: [s, "-p", str(t), "-r", "json", "-o", str(r)],
                    {name: modelscan_verdict},
                    env=SCANNER_ENV,
                )
            )
        elif name == "fickling":
            tools.append(
                Tool(
                    name,
                    version,
                    lambda t, r, s=s: [s, "--check-safety", "--json-output", str(r), str(t)],
                    {"fickling": by_exit},
                    takes_folders=False,
                    env=SCANNER_ENV,
                )
            )
            tools.append(
                Tool(
                    "fickling-api",
                    version,
                    lambda t, _r, p=python: [p, "-c", FICKLING_API, str(t)],
                    {
                        "fickling-api": fickling_api_verdict,
                        "fickling-api-overt": fickling_api_overt,
                    },
                    takes_folders=False,
                    env=SCANNER_ENV,
                )
            )
        else:
            tools.append(
                Tool(
                    name,
                    version,
                    lambda t, _r, s=s: [s, "scan", "--format", "json", "--no-cache", str(t)],
                    {"modelaudit": modelaudit_critical, "modelaudit-exit": by_exit},
                    env=SCANNER_ENV,
                )
            )
    return tools


# --------------------------------------------------------------------------- the corpus


def build_items(folder: Path, markers: Path, fixtures: bool, real: bool) -> list[Item]:
    sys.path.insert(0, str(REPO))
    from tests.helpers.scan_corpus import build_corpus

    corpus = folder / "corpus"
    corpus.mkdir()
    items = [Item(e.path, e.kind, e.name, e.shape) for e in build_corpus(corpus, markers)]
    if fixtures:
        dst = folder / "fixtures"
        dst.mkdir()
        for src in sorted((REPO / "fixtures").glob("*.pt")):
            shutil.copyfile(src, dst / src.name)
            group = "malicious" if src.name == "evil.pt" else "fixtures"
            items.append(Item(dst / src.name, group, f"fixtures/{src.name}", "committed fixture"))
    real_root = REPO.parent / "shared" / "realckpt"
    if real and real_root.is_dir():
        dst = folder / "real"
        for src in sorted(real_root.rglob("*")):
            if src.is_file() and src.name.lower().endswith(REAL_SUFFIXES):
                rel = src.relative_to(real_root)
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst / rel)
                items.append(Item(dst / rel, "real", f"real/{rel}", "real checkpoint"))
    return items


# --------------------------------------------------------------------------- running


def run_one(tool: Tool, target: Path, scratch: Path) -> Run:
    report = scratch / "report.json"
    report.unlink(missing_ok=True)
    out = scratch / "stdout.txt"
    env = {**os.environ, **tool.env}
    with open(out, "wb") as f:
        m = measure(tool.argv(target, report), stdout=f.fileno(), env=env, cwd=scratch, check=False)
    text = out.read_text(errors="replace")
    if report.exists():
        report_text = report.read_text(errors="replace")
        # modelscan writes its JSON to the report file: read it as the tool's output.
        text = text if text.lstrip().startswith("{") else report_text
    else:
        report_text = ""
    return Run(m.returncode, text, report_text, m.wall_s)


def run_all(tools: list[Tool], items: list[Item], folder: Path, scratch: Path, repeats: int):
    for tool in tools:
        for item in items:
            tool.runs[item.path] = run_one(tool, item.path, scratch)
        if tool.takes_folders:
            for _ in range(repeats):
                tool.corpus_s.append(run_one(tool, folder, scratch).wall_s)
        else:
            tool.corpus_s.append(sum(r.wall_s for r in tool.runs.values()))
        print(f"  {tool.name}: done", flush=True)


# --------------------------------------------------------------------------- reporting


def summary_rows(tools: list[Tool], items: list[Item]) -> list[list[str]]:
    rows = []
    by_group = {g: [i for i in items if i.group == g] for g in GROUPS}
    base = next((t for t in tools if t.name == "ckpt scan"), None)
    for tool in tools:
        for label, read in tool.readings.items():
            verdicts = {i.path: read(tool.runs[i.path]) for i in items}
            row = [label, tool.version]
            for group in GROUPS:
                members = by_group[group]
                if members:
                    hit = sum(verdicts[i.path] == FLAGGED for i in members)
                    row.append(f"{hit}/{len(members)}")
                else:
                    row.append("-")
            errors = sum(v == ERROR for v in verdicts.values())
            skipped = sum(v == SKIPPED for v in verdicts.values())
            per_file = statistics.median(r.wall_s for r in tool.runs.values())
            corpus = statistics.median(tool.corpus_s)
            vs = ratio(corpus, statistics.median(base.corpus_s)) if base else "n/a"
            row += [str(errors), str(skipped), f"{corpus:.2f}", vs, f"{per_file:.3f}"]
            rows.append(row)
    return rows


def detail_rows(tools: list[Tool], items: list[Item]) -> list[list[str]]:
    rows = []
    for item in items:
        row = [item.name, item.group]
        for tool in tools:
            for read in tool.readings.values():
                row.append(read(tool.runs[item.path]))
        rows.append(row)
    return rows


def misses(tools: list[Tool], items: list[Item]) -> list[str]:
    lines = []
    for tool in tools:
        for label, read in tool.readings.items():
            missed = [
                f"{i.name} ({read(tool.runs[i.path])})"
                for i in items
                if i.group == "malicious" and read(tool.runs[i.path]) != FLAGGED
            ]
            false = [
                i.name
                for i in items
                if i.group in ("benign", "nonstandard", "real")
                and read(tool.runs[i.path]) == FLAGGED
            ]
            lines.append(f"{label} misses: {', '.join(missed) or 'none'}")
            lines.append(f"{label} flags benign/nonstandard/real: {', '.join(false) or 'none'}")
    return lines


def ckpt_targets(tools: list[Tool], items: list[Item]) -> list[tuple[bool, str]]:
    """ckpt scan's targets: every malicious file dangerous, no other file dangerous, and the
    nonstandard corpus files nonstandard. Empty when ckpt scan did not run."""
    tool = next((t for t in tools if t.name == "ckpt scan"), None)
    if tool is None:
        return []
    verdict = {i.path: ckpt_verdict(tool.runs[i.path]) for i in items}

    def count(group: str, mark: str) -> tuple[int, int]:
        members = [i for i in items if i.group == group]
        return sum(verdict[i.path] == mark for i in members), len(members)

    found, total = count("malicious", FLAGGED)
    wrong = sum(verdict[i.path] == FLAGGED for i in items if i.group != "malicious")
    ns, ns_total = count("nonstandard", NONSTANDARD_MARK)
    return [
        (found == total, f"ckpt scan: malicious files dangerous: {found}/{total} (target: all)"),
        (wrong == 0, f"ckpt scan: other files dangerous: {wrong} (target: 0)"),
        (ns == ns_total, f"ckpt scan: nonstandard corpus files nonstandard: {ns}/{ns_total}"),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scanners-venv", type=Path, default=None)
    parser.add_argument(
        "--tools", default="ckpt,picklescan,modelscan,fickling,modelaudit", help="comma list"
    )
    parser.add_argument("--no-fixtures", action="store_true")
    parser.add_argument("--no-real", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="whole-corpus runs per tool")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--details", action="store_true", help="print the per-file table")
    args = parser.parse_args(argv)
    wanted = [t.strip() for t in args.tools.split(",") if t.strip()]

    print(machine_note())
    print(load_note())
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    tools = ([t] if "ckpt" in wanted and (t := ckpt_tool()) else []) + scanner_tools(
        args.scanners_venv, wanted
    )
    with workdir(args.workdir, keep=args.keep) as root:
        folder, markers = root / "files", Path(tempfile.mkdtemp(prefix="markers-", dir=root))
        folder.mkdir()
        scratch = root / "scratch"
        scratch.mkdir()
        items = build_items(folder, markers, not args.no_fixtures, not args.no_real)
        counts = {g: sum(i.group == g for i in items) for g in GROUPS}
        print(f"corpus: {len(items)} files {counts} in {folder}")
        run_all(tools, items, folder, scratch, args.repeats)
        ran = sorted(p.name for p in markers.iterdir())
        if ran:
            print(f"FAIL: a payload ran during the scans (markers {ran})")
            return 1
        print("no payload ran during the scans (the markers folder is empty)")

    print()
    print(
        fmt_table(
            summary_rows(tools, items),
            [
                "tool",
                "version",
                *(f"{g} flagged" for g in GROUPS),
                "errors",
                "skipped",
                "corpus s",
                "vs ckpt",
                "per file s",
            ],
        )
    )
    print(
        "\nflagged = the tool's verdict (see the docstring); corpus s = one run on the whole "
        "folder (fickling: the sum of its per-file runs); per file s = median per-file run."
    )
    print()
    print("\n".join(misses(tools, items)))
    if args.details:
        labels = [label for t in tools for label in t.readings]
        print()
        print(fmt_table(detail_rows(tools, items), ["file", "group", *labels]))
    targets = ckpt_targets(tools, items)
    print()
    for ok, line in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {line}")
    return 0 if all(ok for ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
