"""``ckpt inspect`` of a remote checkpoint against downloading it first: bytes, requests, time.

Run from the repository root:
    .venv/bin/python benchmarks/bench_remote.py [--size-mb 1024] [--repeats 5]

Serves, on 127.0.0.1, the test suite's Hub look-alike (``tests/helpers/servers.HubServer``:
uvicorn and Starlette's ``FileResponse``, which answers byte ranges, laid out as the Hub's
``ORG/REPO/resolve/REV/FILE``), and generates in its folder (a temp folder, removed at the
end):

* a ~SIZE MiB ``.pt`` and the same tensors as ``.safetensors`` (~350 float32 tensors,
  DataParallel keys: ``common.make_checkpoints``);
* unless ``--no-scaling``, ``.pt`` files of ``--scale-mb`` MiB with more tensors
  (``--scale-tensors``), to show how the requests grow with the tensor count.

Measured as subprocesses (wall time and peak RSS, medians of REPEATS runs after one warm-up,
interleaved round-robin), with ``HF_ENDPOINT`` pointing at the server:

* ``ckpt inspect hf://bench/remote/FILE --json``;
* the baseline: the whole file downloaded from the same server (httpx streaming into a file
  beside the inputs, not fsynced: that favours the baseline), then ``ckpt inspect`` on it.

Requests and response body bytes are counted on the server's side, per run; one more
``--verbose`` run checks that the client counts the same, and the remote ``--json`` is
checked equal to the local file's (its ``path`` aside). Targets (a remote inspect, each
format): at most 4 MiB received and at most 8 requests, whatever the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MIB,
    REPO,
    Measurement,
    Summary,
    ckpt_command,
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

TARGET_BYTES = 4 * MIB
TARGET_REQUESTS = 8
REPO_ID = "bench/remote"

DOWNLOAD = (
    "import sys, httpx\n"
    "with httpx.Client(timeout=120) as client, open(sys.argv[2], 'wb') as out:\n"
    "    with client.stream('GET', sys.argv[1]) as answer:\n"
    "        answer.raise_for_status()\n"
    "        for chunk in answer.iter_bytes(8 << 20):\n"
    "            out.write(chunk)\n"
)
# Settings of the user's that would send the requests elsewhere or add a token.
_UNSET = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "CKPT_REMOTE_TIMEOUT")
_PARTS = ("download (httpx, streamed to a file)", "ckpt inspect FILE --json")
_VERBOSE = re.compile(r"remote: \d+ requests?, .* \([\d,]+ bytes\)")


@dataclass
class Served:
    """One file on the server: its ``hf://`` URL, request path, plain URL and local copy."""

    label: str
    url: str
    path: str
    http: str
    local: Path


@dataclass
class Counted:
    """A command's runs with the server's counts for each; a baseline's two parts too."""

    summary: Summary
    requests: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    parts: tuple[Summary, ...] = ()


def counted(label: str, parts: tuple[str, ...] = ()) -> Counted:
    return Counted(Summary(label), parts=tuple(Summary(p) for p in parts))


def client_env(endpoint: str) -> dict[str, str]:
    """The environment for the commands: ``HF_ENDPOINT`` at the server, no token, no proxy."""
    env = {k: v for k, v in os.environ.items() if k not in _UNSET and "proxy" not in k.lower()}
    env["HF_ENDPOINT"] = endpoint
    return env


def serve_files(hub, size_mb: float, tensors: int, scale: list[int], scale_mb: float):
    """Generate the checkpoints inside the server's folder; the files it serves."""
    folder = hub.root / "models" / REPO_ID / "main"
    folder.mkdir(parents=True)
    pair = make_checkpoints(folder, size_mb, tensors, stem="model")
    files = [
        _served(hub, REPO_ID, p, f".{p.suffix[1:]} {pair.label}")
        for p in (pair.pt, pair.safetensors)
    ]
    for count in scale:
        repo = f"bench/t{count}"
        folder = hub.root / "models" / repo / "main"
        folder.mkdir(parents=True)
        more = make_checkpoints(folder, scale_mb, count, stem="model", formats=("pt",))
        files.append(_served(hub, repo, more.pt, f".pt {more.label}"))
    return files


def _served(hub, repo: str, local: Path, label: str) -> Served:
    path = hub.path(repo, local.name)
    return Served(label, f"hf://{repo}/{local.name}", path, hub.url + path, local)


def counted_run(hub, served: Served, cmd: list[str], env: dict[str, str], out: Counted) -> None:
    """One run of ``cmd``, with what the server received and sent for ``served``."""
    hub.log.clear()
    out.summary.add(measure(cmd, env=env))
    out.requests.append(hub.log.requests(served.path))
    out.sent.append(hub.log.sent(served.path))


def baseline_run(hub, served: Served, scratch: Path, env: dict[str, str], out: Counted) -> None:
    """Download the whole file, then inspect it: one measurement, the two walls added."""
    target = scratch / f"download{served.local.suffix}"
    hub.log.clear()
    got = measure(python_command(DOWNLOAD, served.http, target), env=env)
    out.requests.append(hub.log.requests(served.path))
    out.sent.append(hub.log.sent(served.path))
    looked = measure(ckpt_command("inspect", target, "--json"), env=env)
    target.unlink()
    for part, run in zip(out.parts, (got, looked)):
        part.add(run)
    rss = max(got.peak_rss_kb, looked.peak_rss_kb)
    out.summary.add(Measurement(got.wall_s + looked.wall_s, rss, 0, cpu_s=got.cpu_s + looked.cpu_s))


def check_outputs(served: Served, env: dict[str, str]) -> str:
    """The remote ``--json`` equals the local file's; the client's ``--verbose`` counts."""
    remote = subprocess.run(
        ckpt_command("inspect", served.url, "--json", "--verbose"),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    local = subprocess.run(
        ckpt_command("inspect", served.local, "--json"), capture_output=True, text=True, check=True
    )
    mine, theirs = json.loads(remote.stdout), json.loads(local.stdout)
    mine.pop("path"), theirs.pop("path")
    if mine != theirs:
        raise SystemExit(f"{served.url}: the remote --json differs from the local file's")
    found = _VERBOSE.search(remote.stderr)
    if found is None:
        raise SystemExit(f"no 'remote:' line in --verbose's stderr: {remote.stderr!r}")
    return found[0]


def measure_all(hub, files: list[Served], main: int, repeats: int, scratch: Path, env):
    """Every command, warm-up first, interleaved; the main files also with their baseline."""
    remote = {f.label: counted(f.label) for f in files}
    base = {f.label: counted(f.label, _PARTS) for f in files[:main]}
    for i in range(1 + repeats):
        for served in files:
            cmd = ckpt_command("inspect", served.url, "--json")
            target = remote[served.label] if i else counted("warm-up")
            counted_run(hub, served, cmd, env, target)
            if served.label in base:
                target = base[served.label] if i else counted("warm-up", _PARTS)
                baseline_run(hub, served, scratch, env, target)
    return remote, base


def _row(name: str, c: Counted, against: Counted | None) -> list[str]:
    s = c.summary
    return [
        name,
        f"{s.wall_s:.3f}",
        s.spread,
        f"{s.peak_rss_mb:.1f}",
        f"{max(c.requests)}",
        f"{max(c.sent):,}",
        ratio(s.wall_s, against.summary.wall_s) if against else "",
    ]


HEADERS = [
    "command",
    "wall s (median)",
    "min-max",
    "peak RSS MB",
    "requests (max)",
    "bytes sent (max)",
    "wall/download+inspect",
]


def _part_row(part: Summary) -> list[str]:
    return [
        f"  of which {part.label}",
        f"{part.wall_s:.3f}",
        part.spread,
        f"{part.peak_rss_mb:.1f}",
        "",
        "",
        "",
    ]


def tables(files: list[Served], main: int, remote, base) -> None:
    """The main files against their baseline; the scaling files' requests."""
    rows = []
    for served in files[:main]:
        size = served.local.stat().st_size
        ours, theirs = remote[served.label], base[served.label]
        rows.append(_row(f"ckpt inspect {served.url} --json", ours, theirs))
        rows.append(_row(f"download {size / MIB:.0f} MiB + ckpt inspect", theirs, None))
        rows.extend(_part_row(part) for part in theirs.parts)
    print(fmt_table(rows, HEADERS))
    if len(files) > main:
        print()
        print("== requests as the tensor count grows (ckpt inspect URL --json) ==")
        scaled = [_row(f.label, remote[f.label], None)[:6] for f in files[main:]]
        print(fmt_table(scaled, HEADERS[:6]))


def verdicts(files: list[Served], remote) -> bool:
    """The PASS/FAIL lines of the targets; True when every one holds."""
    ok = True
    for served in files:
        sent, requests = max(remote[served.label].sent), max(remote[served.label].requests)
        for passed, line in (
            (
                sent <= TARGET_BYTES,
                verdict(f"inspect {served.label}: received", sent / MIB, TARGET_BYTES / MIB, "MiB"),
            ),
            (
                requests <= TARGET_REQUESTS,
                verdict(f"inspect {served.label}: requests", requests, TARGET_REQUESTS, "requests"),
            ),
        ):
            print(line)
            ok = ok and passed
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="main checkpoint size (MiB)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors in the main checkpoint")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per command (median)")
    ap.add_argument(
        "--scale-tensors", default="1400,5600", help="tensor counts of the scaling files"
    )
    ap.add_argument("--scale-mb", type=float, default=64, help="size of each scaling file (MiB)")
    ap.add_argument("--no-scaling", action="store_true", help="leave the scaling files out")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.helpers.servers import HubServer

    scale = [] if args.no_scaling else [int(n) for n in args.scale_tensors.split(",") if n]
    print(f"machine: {machine_note()}")
    print(f"before: {load_note()}")
    with workdir(args.workdir, keep=args.keep) as folder:
        (folder / "hub").mkdir()
        hub = HubServer(folder / "hub")
        hub.start()
        try:
            print(f"generating checkpoints in {folder} ...", flush=True)
            files = serve_files(hub, args.size_mb, args.tensors, scale, args.scale_mb)
            env = client_env(hub.url)
            client = {f.label: check_outputs(f, env) for f in files}
            print(f"measuring ({args.repeats} timed runs each after 1 warm-up, interleaved) ...")
            remote, base = measure_all(hub, files, 2, args.repeats, folder, env)
        finally:
            hub.stop()
        print(f"(after measuring: {load_note()})")
        print("server: uvicorn + Starlette in this process, on 127.0.0.1; bytes = response bodies")
        print()
        tables(files, 2, remote, base)
        print()
        print("client's own count (--verbose, one more run):")
        for name, text in client.items():
            print(f"  {name}: {text}")
        print()
        ok = verdicts(files[:2], remote)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
