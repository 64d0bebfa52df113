"""One fuzzing session: the sandboxed workers, the ``ckpt`` runs, and the checks after each.

:class:`Session` runs an input through the library (``ct.inspect`` in the sandboxed worker,
many inputs per second) or through the command line (``python -m ckpt_tools`` in a real,
bounded process: ``inspect --json`` and rewrites), asks the reference readers, and returns
the :class:`~fuzzkit.checks.Finding` list. :class:`~fuzzkit.registry.Registry` files
them as regression inputs under ``tests/fuzz/regressions/``.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import checks
from .checks import Finding
from .workers import (
    CLI_MEMORY,
    CLI_TIMEOUT,
    ORACLE_MEMORY,
    ORACLE_TIMEOUT,
    CliResult,
    CliServer,
    Worker,
)

OLD_OUTPUT = b"an older output that a failed rewrite must leave alone\n"


@dataclass(frozen=True)
class Plan:
    """One rewrite: the command, its extra arguments, and the state of the output path."""

    command: str
    args: tuple[str, ...] = ()
    out_ext: str = ".pt"
    preexisting: bool = False
    force: bool = False

    def label(self) -> str:
        flags = (" --force" if self.force else "") + (" [OUT exists]" if self.preexisting else "")
        return f"{self.command} {' '.join(self.args)}{flags}".strip()


def rewrite_plans(in_ext: str) -> list[Plan]:
    """One plan per rewrite command, fresh output path (what a replay runs)."""
    other = ".pt" if in_ext == ".safetensors" else ".safetensors"
    return [
        Plan("strip-module", out_ext=in_ext),
        Plan("add-module", out_ext=in_ext),
        Plan("rename", ("--sub", "module.=net."), out_ext=in_ext),
        Plan("convert", out_ext=other),
        Plan("retag", ("--map", "cpu=cuda:1"), out_ext=in_ext),
        Plan("strip-module", out_ext=in_ext, preexisting=True, force=True),
    ]


def draw_plan(d: Any, in_ext: str) -> Plan:
    """A random rewrite for the fuzzer (``d``: a :class:`~fuzzkit.draw.Draw`)."""
    other = ".pt" if in_ext == ".safetensors" else ".safetensors"
    command, args, out_ext = d.choice(
        (
            ("strip-module", (), in_ext),
            ("strip-module", (), in_ext),
            ("add-module", (), in_ext),
            ("rename", ("--sub", "module.=net."), in_ext),
            ("convert", (), other),
            ("convert", ("--drop-extras",), other),
            ("convert", (), ".pt"),
            ("retag", ("--map", "cpu=cuda:1"), in_ext),  # to .safetensors: refused (exit 2)
            ("retag", ("--map", "cuda:1=cpu"), ".pt"),
        )
    )
    if d.bool(15):
        args = (*args, "--verify", "full")
    state = d.choice(("fresh", "fresh", "force", "exists"))
    return Plan(command, tuple(args), out_ext, state != "fresh", state == "force")


def sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _exception_name(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        m = re.match(
            r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)|[A-Z]\w+):", line
        )
        if m:
            return m.group(1).rsplit(".", 1)[-1]
    return "?"


@dataclass
class Outcome:
    findings: list[Finding] = field(default_factory=list)
    runs: int = 0


class Session:
    """Workers, a scratch folder, and the checks; one per test (or campaign)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.marker = workdir / "PWNED-if-this-exists"
        self.oracle = Worker("oracle_worker.py", ORACLE_MEMORY, self.marker, workdir)
        self._oracle_answers: dict[str, dict[str, Any]] = {}
        self.lib = Worker("lib_worker.py", CLI_MEMORY, self.marker, workdir)
        self.cli = CliServer(self.marker, workdir)
        self.stats: Counter[str] = Counter()
        self.cases = 0
        self.cli_timeout = CLI_TIMEOUT

    def start(self) -> None:
        self.oracle.warm_up()
        self.lib.warm_up()
        self.cli.warm_up()

    def close(self) -> None:
        self.oracle.close()
        self.lib.close()
        self.cli.close()

    # -- common ------------------------------------------------------------------------------

    def _case(self, data: bytes, ext: str) -> tuple[Path, Path]:
        self.cases += 1
        case = self.workdir / f"case{self.cases}"
        shutil.rmtree(case, ignore_errors=True)
        (case / "in").mkdir(parents=True)
        path = case / "in" / f"ckpt{ext}"
        path.write_bytes(data)
        return case, path

    def _after(self, path: Path, digest: str | None, command: str) -> list[Finding]:
        findings = []
        if self.marker.exists():
            findings.append(
                Finding(0, "executed", command, "marker", "the payload ran: the marker file exists")
            )
            self.marker.unlink()
        if sha(path) != digest:
            findings.append(Finding(0, "input-changed", command, "hash", "the input file changed"))
        return findings

    def ask_oracle(self, path: Path) -> dict[str, Any]:
        # The same bytes get the same answer: the library's and the command's checks of one
        # input ask once (an input torch hangs on costs its timeout once, not twice). Under
        # the same suffix only: torch.load reads a path ending in .safetensors with safetensors.
        key = f"{sha(path)}{path.suffix}"
        answer = self._oracle_answers.get(key)
        if answer is None:
            answer = self._oracle_answers[key] = self.oracle.call(
                {"path": str(path)}, timeout=ORACLE_TIMEOUT
            )
            if len(self._oracle_answers) > 64:
                self._oracle_answers.pop(next(iter(self._oracle_answers)))
        self.stats["oracle-" + _verdict(answer)] += 1
        return answer

    # -- the library, in the sandboxed worker --------------------------------------------------

    def check_library(
        self, data: bytes, ext: str, mutations: Sequence[str], pristine: bool = False
    ) -> list[Finding]:
        case, path = self._case(data, ext)
        digest = sha(path)
        answer = self.lib.call({"path": str(path)}, timeout=checks.TIME_BOUND)
        self.stats["library-runs"] += 1
        self.stats["library-" + ("ok" if answer.get("ok") else "refused")] += 1
        findings = checks.check_library_answer(answer)
        oracle = self.ask_oracle(path)
        if "timeout" not in answer and "died" not in answer and not answer.get("crash"):
            findings += checks.check_inspect(answer, oracle, mutations, "ct.inspect", pristine)
        findings += checks.check_scan(answer, oracle)
        findings += self._after(path, digest, "ct.inspect")
        shutil.rmtree(case, ignore_errors=True)
        return findings

    # -- the command line ----------------------------------------------------------------------

    def _run(self, args: Sequence[str], cwd: Path) -> CliResult:
        self.stats["cli-runs"] += 1
        return self.cli.run(args, cwd, timeout=self.cli_timeout)

    def _process_checks(self, res: CliResult, command: str) -> list[Finding]:
        findings = []
        if res.timed_out or res.seconds > min(checks.TIME_BOUND, self.cli_timeout):
            findings.append(
                Finding(
                    8,
                    "hang",
                    command,
                    "timeout",
                    f"ran {res.seconds:.1f} s (killed: {res.timed_out})",
                )
            )
            return findings
        text = res.stderr + res.stdout
        if "Traceback (most recent call last)" in text:
            name = _exception_name(res.stderr)
            findings.append(
                Finding(
                    8,
                    "traceback",
                    command,
                    name,
                    f"exit {res.returncode} with a traceback: {_last_line(res.stderr)[:200]}",
                    {"stderr": res.stderr[-3000:]},
                )
            )
        elif res.returncode not in checks.DOCUMENTED_EXIT_CODES:
            findings.append(
                Finding(
                    8,
                    "exit-code",
                    command,
                    str(res.returncode),
                    f"exit {res.returncode}: {res.stderr.strip()[-300:]}",
                )
            )
        elif res.returncode != 0 and (lines := len(res.stderr.strip().splitlines())) != 1:
            findings.append(
                Finding(
                    8,
                    "stderr-lines",
                    command,
                    str(min(lines, 2)),
                    f"exit {res.returncode} with {lines} stderr lines: "
                    f"{res.stderr.strip()[:300]!r}",
                )
            )
        return findings

    def check_cli(
        self,
        data: bytes,
        ext: str,
        mutations: Sequence[str],
        plans: Sequence[Plan],
        pristine: bool = False,
        oracle: dict[str, Any] | None = None,
    ) -> list[Finding]:
        case, path = self._case(data, ext)
        digest = sha(path)
        oracle = oracle if oracle is not None else self.ask_oracle(path)
        res = self._run(["inspect", str(path), "--json"], case)
        findings = self._process_checks(res, "inspect")
        ours: dict[str, Any] = {"ok": False, "exit_code": res.returncode, "message": res.stderr}
        if res.returncode == 0:
            try:
                ours = {"ok": True, "info": json.loads(res.stdout)}
            except ValueError:
                findings.append(Finding(8, "bad-json", "inspect", "stdout", res.stdout[:200]))
        if not res.timed_out:
            findings += checks.check_inspect(ours, oracle, mutations, "inspect", pristine)
        findings += self._after(path, digest, "inspect")
        for i, plan in enumerate(plans):
            findings += self._rewrite(case, path, digest, i, plan, ours, oracle, mutations)
        shutil.rmtree(case, ignore_errors=True)
        return findings

    def _rewrite(
        self,
        case: Path,
        path: Path,
        digest: str | None,
        i: int,
        plan: Plan,
        ours: dict[str, Any],
        oracle: dict[str, Any],
        mutations: Sequence[str],
    ) -> list[Finding]:
        out_dir = case / f"out{i}"
        out_dir.mkdir()
        out = out_dir / f"out{plan.out_ext}"
        if plan.preexisting:
            out.write_bytes(OLD_OUTPUT)
        old = sha(out)
        argv = [plan.command, str(path), str(out), *plan.args, "--json"]
        if plan.force:
            argv.append("--force")
        res = self._run(argv, case)
        command = plan.command
        findings = self._process_checks(res, command)
        findings += self._after(path, digest, command)
        left = sorted(p.name for p in out_dir.iterdir() if p != out)
        if left:
            findings.append(
                Finding(9, "temp-left", command, "files", f"left in the output folder: {left}")
            )
        if res.timed_out:
            return _label(findings, plan)
        if res.returncode != 0:
            if plan.preexisting and sha(out) != old:
                findings.append(
                    Finding(
                        9,
                        "old-output-damaged",
                        command,
                        "changed",
                        f"exit {res.returncode}, OUT changed",
                    )
                )
            if not plan.preexisting and out.exists():
                findings.append(
                    Finding(
                        9, "partial-output", command, "exists", f"exit {res.returncode}, OUT exists"
                    )
                )
            if res.returncode == 6 and not (plan.preexisting and not plan.force):
                findings.append(self._exit6(res, ours, oracle))
            return _label(findings, plan)
        if plan.preexisting and not plan.force and sha(out) != old:
            findings.append(
                Finding(
                    0,
                    "clobbered",
                    command,
                    "no-force",
                    "exit 0 replaced an existing OUT without --force",
                )
            )
        written = out.exists() and sha(out) != old
        self.stats["rewrites-written" if written else "rewrites-not-written"] += 1
        findings += self._safety(command, ours, oracle, mutations, plan.out_ext)
        if written:
            result = _json(res.stdout)
            findings += self._output(out, plan, result, ours, oracle)
        return _label(findings, plan)

    def _exit6(self, res: CliResult, ours: dict[str, Any], oracle: dict[str, Any]) -> Finding:
        fmt = ours.get("info", {}).get("format") if ours.get("ok") else None
        _ref_name, ref = checks.reference(fmt, oracle)
        selected = ours.get("info", {}).get("selected", []) if ours.get("ok") else []
        node = checks.navigate(ref["tree"], selected) if ref.get("ok") else None
        odd_keys = checks.key_types(node) - {"str"}
        message = f"exit 6 after writing: {res.stderr.strip()[:300]}"
        if odd_keys:
            return Finding(
                4, "verify-failed", res.argv[0], "keys", message + f" (keys: {odd_keys})"
            )
        return Finding(3, "verify-failed", res.argv[0], checks.short_error(res.stderr), message)

    def _safety(
        self,
        command: str,
        ours: dict[str, Any],
        oracle: dict[str, Any],
        mutations: Sequence[str],
        out_ext: str = ".pt",
    ) -> list[Finding]:
        """A rewrite that exits 0 must be of a file that is safe and readable as torch reads it.

        A pickled nn.Module's recovered state dict may go to safetensors, which
        holds its tensors only (none of the module objects, so none of their globals).
        """
        info = ours.get("info", {}) if ours.get("ok") else {}
        if out_ext == ".safetensors" and info.get("pickled_module"):
            return []
        fmt = info.get("format")
        if fmt == "torchscript":
            return [
                Finding(
                    2, "rewrote-unsafe", command, "torchscript", "exit 0 on a TorchScript archive"
                )
            ]
        if info.get("unsafe_globals"):
            return [
                Finding(
                    2,
                    "rewrote-unsafe",
                    command,
                    "unsafe-globals",
                    f"exit 0 on a file with unsafe globals {info['unsafe_globals']}",
                )
            ]
        if "torch" not in oracle:
            return []
        ref_name, ref = checks.reference(fmt, oracle)
        if ref.get("ok"):
            return []
        if checks.unsafe_named(ref):
            return [
                Finding(
                    2,
                    "rewrote-unsafe",
                    command,
                    "reference-unsafe",
                    f"exit 0 on a file {ref_name} refuses as unsafe ({checks.unsafe_named(ref)})",
                )
            ]
        if not ours.get("ok"):
            return [
                Finding(
                    checks.format_class(mutations),
                    "rewrote-refused",
                    command,
                    f"inspect-refuses:{checks.family(mutations)}",
                    f"exit 0 on a file inspect refuses and {ref_name} refuses",
                )
            ]
        return [
            Finding(
                checks.format_class(mutations),
                "rewrote-refused",
                command,
                f"{ref_name}:{checks.family(mutations)}",
                f"exit 0 on a file {ref_name} refuses ({checks.short_error(ref.get('error', ''))})",
            )
        ]

    def _output(
        self,
        out: Path,
        plan: Plan,
        result: dict[str, Any],
        ours: dict[str, Any],
        oracle: dict[str, Any],
    ) -> list[Finding]:
        """The output loads (torch weights_only + mmap, or safetensors) and holds the input."""
        command = plan.command
        is_st = out.suffix == ".safetensors"
        views = self.oracle.call({"path": str(out), "output": "st" if is_st else "torch"}, 60)
        if "timeout" in views or "died" in views or "worker_error" in views:
            return [Finding(3, "output-unloadable", command, "oracle-died", f"{views}"[:300])]
        self.stats["outputs-loaded"] += 1
        for loader, view in views.items():
            if not view.get("ok"):
                return [
                    Finding(
                        3,
                        "output-unloadable",
                        command,
                        f"{loader}:{checks.short_error(view.get('error', ''))}",
                        f"exit 0 but {loader} cannot load the output: "
                        f"{view.get('error', '')[-300:]}",
                    )
                ]
        fmt = ours.get("info", {}).get("format") if ours.get("ok") else None
        ref_name, ref = checks.reference(fmt, oracle)
        if not ref.get("ok") or not ours.get("ok"):
            return []
        out_view = views["safetensors" if is_st else "torch"]
        return compare_output(plan, result, ours["info"], ref_name, ref, out_view)


def compare_output(
    plan: Plan,
    result: dict[str, Any],
    info: dict[str, Any],
    ref_name: str,
    ref: dict[str, Any],
    out_view: dict[str, Any],
) -> list[Finding]:
    """Tensors of the output vs the reference's view of the input, under the command's renames."""
    command = plan.command
    selected = (
        result.get("selected", info.get("selected", [])) if result else info.get("selected", [])
    )
    in_tree = ref["tree"]
    in_sd = checks.navigate(in_tree, selected) if ref_name != "safetensors" else in_tree
    out_is_st = plan.out_ext == ".safetensors"
    same_kind = not out_is_st and ref_name != "safetensors"
    out_sd = checks.navigate(out_view["tree"], selected) if same_kind else out_view["tree"]
    if in_sd is None or out_sd is None:
        return [Finding(3, "output-differs", command, "selection", f"selected {selected} missing")]
    theirs = checks.tensor_items(in_sd)
    mine = checks.tensor_items(out_sd)

    def differs(detail: str, message: str) -> list[Finding]:
        return [Finding(3, "output-differs", command, detail, message)]

    dropped = set(result.get("dropped") or []) if out_is_st else set()
    if dropped:  # tied duplicates safetensors cannot hold: each must share a kept storage
        kept = {t["storage"] for a, t in theirs if a not in dropped}
        lost = [a for a, t in theirs if a in dropped and t["storage"] not in kept]
        if lost:
            return differs("dropped", f"dropped {lost}, which share no storage with a kept tensor")
        theirs = [(a, t) for a, t in theirs if a not in dropped]

    if len(theirs) != len(mine):
        return differs("count", f"{len(theirs)} tensors in, {len(mine)} out")
    if not same_kind:
        theirs, mine = sorted(theirs, key=lambda p: p[0]), sorted(mine, key=lambda p: p[0])
    sub = plan.args[1].split("=", 1) if plan.command == "rename" else None
    for (a, t_in), (b, t_out) in zip(theirs, mine):
        expected_ok = {
            "strip-module": b != "" and (a.endswith(b) or _fsdp_clean(a).endswith(b)),
            "add-module": b == "module." + a,
            "rename": b == ((sub[1] + a[len(sub[0]) :]) if sub and a.startswith(sub[0]) else a),
        }.get(command, a == b)
        if not expected_ok:
            return differs("names", f"{a!r} came out as {b!r}")
        fields = ["dtype", "shape", "sha"]
        if same_kind:
            fields += ["stride", "offset", "storage_nbytes", "param"]
        for f in fields:
            if t_in.get(f) != t_out.get(f):
                return differs(f, f"{a}: {f} in {t_in.get(f)!r}, out {t_out.get(f)!r}")
        if same_kind:
            want = t_in["device"]
            if command == "retag":
                old, new = plan.args[1].split("=", 1)
                want = new if want == old else want
            if t_out["device"] != want:
                return differs("device", f"{a}: device {t_in['device']!r} -> {t_out['device']!r}")
    if same_kind:
        names = {a: b for (a, _), (b, _) in zip(theirs, mine)}
        p_in = checks.partition((names[a], t["storage"]) for a, t in theirs)
        p_out = checks.partition((b, t["storage"]) for b, t in mine)
        if p_in != p_out:
            return differs("sharing", "storage sharing changed")
        rest_in = _normal(checks.without(in_tree, selected), command)
        rest_out = _normal(checks.without(out_view["tree"], selected), command)
        if rest_in != rest_out:
            return differs("rest-of-tree", "entries beside the state dict changed")
    return []


def _fsdp_clean(name: str) -> str:
    """The name FSDP itself gives a parameter: its wrapper segments removed wherever they are.

    FSDP (and activation checkpointing) wrap modules at any depth, so their segments sit in
    the middle of keys; torch's own ``clean_tensor_name`` is the reference, imported only
    when a name is not a plain suffix (the campaign process otherwise never imports torch).
    """
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return clean_tensor_name(name)


def _normal(node: Any, command: str) -> Any:
    if isinstance(node, dict):
        drop = {"storage"} | ({"device"} if command == "retag" else set())
        return {k: _normal(v, command) for k, v in node.items() if k not in drop}
    if isinstance(node, list):
        return [_normal(v, command) for v in node]
    return node


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _label(findings: list[Finding], plan: Plan) -> list[Finding]:
    for f in findings:
        f.context.setdefault("plan", asdict(plan))
    return findings


def _verdict(answer: dict[str, Any]) -> str:
    if "timeout" in answer or "died" in answer:
        return "hung-or-died"
    for name in ("torch", "safetensors", "pickle"):
        if answer.get(name, {}).get("ok"):
            return f"{name}-accepts"
    return "all-refuse"
