"""Start-up: ``ckpt --version`` beside ``python -c pass``, ``ckpt inspect`` beside ckptkit.

Run:  .venv/bin/python benchmarks/bench_startup.py [--size-mb 1024] [--repeats 21]
          [--ckptkit /path/to/venv/bin/ckptkit] [--installed]

ckptkit (``pip install 'ckptkit[cli]==0.3.0'``, best in a venv of its own) is found by
``--ckptkit`` or the ``CKPTKIT`` environment variable; without it, its row is skipped.

Generates a ~SIZE MiB ``.pt`` (torch zip) and ``.safetensors`` with ~350 float32 tensors in a
temp folder (removed at the end), compiles the bytecode of ckpt_tools, click and tabulate
(and ckptkit's site-packages) so that no run compiles a module, then measures each command as
a subprocess, interleaved round-robin, median of REPEATS runs after one warm-up round:

* ``python -c pass`` (this venv's interpreter: its start includes the editable-install
  finder that the venv's ``.pth`` runs, as ``ckpt``'s does) and ``ckpt --version``;
* ``ckpt inspect FILE`` (table) and ``ckpt inspect FILE --json`` for both files;
* ``ckptkit info --json FILE.safetensors``.

Ratios are against the baselines measured in the same run. Targets: ``ckpt --version`` at
most 1.5x ``python -c pass``; ``ckpt inspect`` of the .safetensors at or below ckptkit's
``info --json``; ``ckpt inspect`` of the .pt in 0.1 s or less. Seconds depend on the machine:
with ckptkit, a last block scales the .pt's time by ckptkit's time here against its time
where the targets were set (an estimate, not a verdict), and ``python -c 'import click'``
shows what any click command pays before it parses. ``--installed`` times a
regular (non-editable) install of this checkout instead (see ``common.installed_copy``),
whose interpreter starts without the editable finder.

The inspect targets are judged with ``--installed``: users run a regular install, and ckptkit
is timed as one, while the development venv's editable finder runs at every start of its
interpreter. Without the flag the figures describe the development venv.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PYTHON,
    REPO,
    Summary,
    ckpt_command,
    fmt_table,
    installed_copy,
    load_note,
    machine_note,
    make_checkpoints,
    measure,
    python_command,
    ratio,
    use_ckpt,
    verdict,
    workdir,
)

VERSION_TARGET = 1.5  # ckpt --version / python -c pass
PT_TARGET_S = 0.1  # ckpt inspect of the .pt
CKPTKIT_TARGET = 1.0  # ckpt inspect of the .safetensors / ckptkit info --json
# ckptkit info --json of a 1 GB .safetensors on the machine where these targets were set: the
# absolute targets are shown beside this machine's speed, scaled by its time for the same.
CKPTKIT_WHERE_SET_S = 0.063


def ckptkit_executable(given: str | None) -> str | None:
    """ckptkit's console script from ``--ckptkit`` or ``$CKPTKIT``; None (with a note) if absent."""
    path = given or os.environ.get("CKPTKIT")
    if not path:
        print("ckptkit: not given (--ckptkit PATH or CKPTKIT=PATH): its row is skipped")
        return None
    found = shutil.which(path)
    if found is None:
        print(f"ckptkit: {path!r} is not an executable: its row is skipped")
        return None
    return found


def compile_bytecode(ckptkit: str | None) -> None:
    """Compile what the timed commands import, so that no run compiles a module.

    This machine may set PYTHONDONTWRITEBYTECODE: then an import never writes the cache it
    would read next time, and every run would compile from source.
    """
    import click
    import tabulate

    folders = [REPO / "ckpt_tools", Path(click.__file__).parent, Path(tabulate.__file__).parent]
    subprocess.run([PYTHON, "-m", "compileall", "-q", *map(str, folders)], check=True)
    if ckptkit is not None:
        first = Path(ckptkit).read_text(errors="replace").splitlines()[0]
        python = first[2:].strip() if first.startswith("#!") else PYTHON
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        subprocess.run([python, "-m", "compileall", "-q", site], check=True)


def interleaved(commands: dict[str, list[str]], repeats: int) -> dict[str, Summary]:
    """Each command once a round, ``1 + repeats`` rounds; the first (warm-up) is dropped."""
    out = {name: Summary(name) for name in commands}
    for i in range(1 + repeats):
        for name, cmd in commands.items():
            m = measure(cmd)
            if i:
                out[name].add(m)
    return out


def commands_for(pt: Path, st: Path, ckptkit: str | None) -> dict[str, list[str]]:
    """The timed commands by name."""
    commands = {
        "python -c pass": python_command("pass"),
        "python -c 'import click'": python_command("import click"),
        "ckpt --version": ckpt_command("--version"),
        "ckpt inspect .safetensors": ckpt_command("inspect", st),
        "ckpt inspect .safetensors --json": ckpt_command("inspect", st, "--json"),
        "ckpt inspect .pt": ckpt_command("inspect", pt),
        "ckpt inspect .pt --json": ckpt_command("inspect", pt, "--json"),
    }
    if ckptkit is not None:
        commands["ckptkit info --json .safetensors"] = [ckptkit, "info", "--json", str(st)]
    return commands


def report(results: dict[str, Summary]) -> list[tuple[bool, str]]:
    """Print the table of medians and ratios; the target checks as (passed, line)."""

    def row(name: str, base: str | None) -> list[str]:
        s = results[name]
        b = results[base] if base else None
        return [
            name,
            f"{s.wall_s:.3f}",
            f"{s.best_s:.3f}",
            f"{s.cpu_s:.3f}",
            ratio(s.wall_s, b.wall_s) if b else "",
            ratio(s.best_s, b.best_s) if b else "",
            ratio(s.cpu_s, b.cpu_s) if b else "",
            base or "",
        ]

    kit = "ckptkit info --json .safetensors"
    has_kit = kit in results
    rows = [
        row("python -c pass", None),
        row("python -c 'import click'", "python -c pass"),
        row("ckpt --version", "python -c pass"),
        row("ckpt inspect .safetensors", kit if has_kit else None),
        row("ckpt inspect .safetensors --json", kit if has_kit else None),
        *([row(kit, None)] if has_kit else []),
        row("ckpt inspect .pt", None),
        row("ckpt inspect .pt --json", None),
    ]
    headers = ["command", "wall s", "best s", "cpu s", "wall", "best", "cpu", "ratios against"]
    print(fmt_table(rows, headers))
    print(
        "(wall: medians; best: the fastest run, the least disturbed by other load; cpu: "
        "median user + system time)"
    )
    version = results["ckpt --version"].wall_s / results["python -c pass"].wall_s
    checks = [
        (
            version <= VERSION_TARGET,
            verdict("ckpt --version / python -c pass", version, VERSION_TARGET, "x"),
        )
    ]
    for name in ("ckpt inspect .pt", "ckpt inspect .pt --json"):
        s = results[name].wall_s
        checks.append((s <= PT_TARGET_S, verdict(name, s, PT_TARGET_S, "s")))
    if has_kit:
        for name in ("ckpt inspect .safetensors", "ckpt inspect .safetensors --json"):
            r = results[name].wall_s / results[kit].wall_s
            checks.append((r <= CKPTKIT_TARGET, verdict(f"{name} / ckptkit", r, 1.0, "x")))
        scaled_estimates(results, results[kit].wall_s)
    else:
        print("(ckptkit not given: the .safetensors comparison is skipped)")
    return checks


def scaled_estimates(results: dict[str, Summary], ckptkit_s: float) -> None:
    """The absolute targets beside this machine's speed: each time scaled by how much slower
    ckptkit runs here than where the targets were set. An estimate, not a verdict."""
    scale = CKPTKIT_WHERE_SET_S / ckptkit_s
    print(
        f"scaled: ckptkit info --json took {ckptkit_s:.3f} s here, {CKPTKIT_WHERE_SET_S} s where "
        f"the targets were set ({1 / scale:.2f}x); at that speed:"
    )
    for name in ("ckpt inspect .pt", "ckpt inspect .pt --json"):
        print(f"  {name}: about {results[name].wall_s * scale:.3f} s (target <= {PT_TARGET_S} s)")
    click = results["python -c 'import click'"].wall_s / results["python -c pass"].wall_s
    print(
        f"  ckpt --version pays click's import: python -c 'import click' is {click:.2f}x "
        f"python -c pass here (target for --version <= {VERSION_TARGET}x)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=1024, help="checkpoint size (MiB)")
    ap.add_argument("--tensors", type=int, default=350, help="tensors in each checkpoint")
    ap.add_argument("--repeats", type=int, default=21, help="timed rounds (median)")
    ap.add_argument("--ckptkit", default=None, help="ckptkit's executable (or $CKPTKIT)")
    ap.add_argument("--installed", action="store_true", help="time a non-editable install")
    ap.add_argument("--workdir", default=None, help="parent folder for generated files")
    args = ap.parse_args(argv)

    ckptkit = ckptkit_executable(args.ckptkit)
    print(f"machine: {machine_note()}")
    compile_bytecode(ckptkit)
    print("bytecode: compiled (ckpt_tools, click, tabulate" + (", ckptkit)" if ckptkit else ")"))
    with workdir(args.workdir) as folder, contextlib.ExitStack() as stack:
        if args.installed:
            python, script = stack.enter_context(installed_copy(folder))
            use_ckpt(python, script)
            print(f"timing a regular install: {script}")
        else:
            print("timing the development venv (an editable install: its finder runs at start)")
        print(f"generating checkpoints in {folder} ...", flush=True)
        pair = make_checkpoints(folder, args.size_mb, args.tensors, stem="startup")
        print(f"  {pair.label}: .pt {pair.pt.stat().st_size / 2**20:.0f} MiB")
        print(f"before: {load_note()}")
        print(f"measuring ({args.repeats} interleaved rounds after 1 warm-up, warm cache) ...")
        results = interleaved(commands_for(pair.pt, pair.safetensors, ckptkit), args.repeats)
        print(f"after: {load_note()}")
        print()
        checks = report(results)
    print()
    for _, line in checks:
        print(line)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
