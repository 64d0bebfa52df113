"""The invariants and the differential oracle, as pure functions over recorded results.

Every check returns :class:`Finding` objects. A finding names the class it belongs to
(:data:`CLASS_TITLES`: 1..9; 0 for a promise outside those classes: something ran, or the
input changed) and a ``signature`` coarse enough that one bug gives one signature, so a
campaign of thousands of inputs reports each bug once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .mutators import FORMAT_DECISIONS

DOCUMENTED_EXIT_CODES = frozenset({0, 2, 3, 4, 5, 6, 7})
REFUSALS = frozenset({3, 4, 5})
TORCH_FORMATS = frozenset({"torch-zip", "torch-legacy", "torch-tar"})
TIME_BOUND = 20.0  # seconds for one command on a file of a few KB
CLASS_TITLES = {
    0: "a promise outside the nine classes (something ran, or the input changed)",
    1: "reading a file differently from torch",
    2: "rewrites that skip their safety checks",
    3: "outputs torch cannot read, with exit 0",
    4: "non-string keys",
    5: "non-regular files",
    6: "paths that leave the folder",
    7: "validation below the letter of the formats",
    8: "resource failures as tracebacks",
    9: "a temp file (or a partial output) left behind",
}


@dataclass
class Finding:
    klass: int
    invariant: str
    command: str
    detail: str
    message: str
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def signature(self) -> str:
        return f"c{self.klass}:{self.invariant}:{self.command}:{self.detail}"

    def __str__(self) -> str:
        return f"[{self.signature}] {self.message}"


# ---------------------------------------------------------------------------------------------
# Trees as the oracle worker describes them


def dict_items(node: dict[str, Any] | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    if not node or node.get("t") != "dict":
        return []
    return [(k, v) for k, v in node["items"]]


def navigate(tree: dict[str, Any], path: Sequence[str]) -> dict[str, Any] | None:
    """The node at ``path`` (keys as inspect spells them: strings, ints as digits)."""
    node: dict[str, Any] | None = tree
    for part in path:
        found = None
        for key, value in dict_items(node):
            if key["str"] == part and key["type"] in ("str", "int"):
                found = value
                if key["type"] == "str":
                    break
        if found is None:
            return None
        node = found
    return node


def tensor_items(node: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    return [(k["str"], v) for k, v in dict_items(node) if v.get("t") == "tensor"]


def tree_tensors(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]] | None:
    """Every tensor under ``node`` by its dotted path, as inspect names those of a root that is
    no mapping (``<root>`` for the root itself); None where the reference was truncated."""
    kind = node.get("t")
    if kind == "truncated":
        return None
    if kind == "tensor":
        return [(path or "<root>", node)]
    if kind == "dict":
        children = [(k["str"], v) for k, v in node["items"]]
    elif kind in ("list", "tuple"):
        children = [(str(i), v) for i, v in enumerate(node["items"])]
    else:
        return []
    found: list[tuple[str, dict[str, Any]]] = []
    for name, child in children:
        below = tree_tensors(child, f"{path}.{name}" if path else name)
        if below is None:
            return None
        found += below
    return found


def key_types(node: dict[str, Any] | None) -> set[str]:
    return {k["type"] for k, _ in dict_items(node)}


def partition(pairs: Iterable[tuple[str, Any]]) -> set[frozenset[str]]:
    groups: dict[Any, set[str]] = {}
    for name, key in pairs:
        groups.setdefault(key, set()).add(name)
    return {frozenset(g) for g in groups.values()}


def without(tree: dict[str, Any], path: Sequence[str]) -> Any:
    """The tree with the node at ``path`` replaced by a placeholder (to compare the rest)."""
    if not path:
        return {"t": "selected"}
    if tree.get("t") != "dict":
        return tree
    items = []
    replaced = False
    for key, value in tree["items"]:
        if not replaced and key["str"] == path[0]:
            items.append([key, without(value, path[1:])])
            replaced = True
        else:
            items.append([key, value])
    return {**tree, "items": items}


def strip_sha(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_sha(v) for k, v in node.items() if k not in ("storage",)}
    if isinstance(node, list):
        return [strip_sha(v) for v in node]
    return node


# ---------------------------------------------------------------------------------------------
# Choosing the reference reader


def reference(our_format: str | None, oracle: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Which reference reads this file in the format we say it has, and what it said."""
    if our_format == "safetensors":
        return "safetensors", oracle.get("safetensors", {"ok": False, "error": "not asked"})
    if our_format == "pickle":
        return "pickle", oracle.get("pickle", {"ok": False, "error": "not a pickle"})
    return "torch", oracle.get("torch", {"ok": False, "error": "not asked"})


def unsafe_named(ref: dict[str, Any]) -> list[str]:
    return list(ref.get("unsafe") or [])


def covers(ours: Sequence[str], theirs: Sequence[str]) -> bool:
    """Every global the reference refused is among ours (torch drops ``builtins.``)."""
    # A name torch takes from a GLOBAL line may hold spaces of its own: compared whole too.
    tails = {q.rsplit(".", 1)[-1] for q in ours}
    tails |= {q.replace(" ", ".").rsplit(".", 1)[-1] for q in ours}
    return all(t.rsplit(".", 1)[-1] in tails for t in theirs)


def format_class(mutations: Sequence[str]) -> int:
    """1 when a mutation changed which bytes make up the file, 7 when it broke its fields."""
    families = {".".join(m.split(".")[:2]) for m in mutations}
    return 1 if families & FORMAT_DECISIONS else 7


def family(mutations: Sequence[str]) -> str:
    return ".".join(mutations[-1].split(".")[:2]) if mutations else "seed"


def short_error(text: str) -> str:
    """A stable few words of an error message (digits and quoted names dropped)."""
    core = text.split("WeightsUnpickler error:")[-1]
    lines = [line.strip() for line in core.splitlines() if line.strip()]
    if not lines:
        return "?"
    first = lines[0] if "Weights only load failed" not in lines[0] else lines[-1]
    first = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "_", first)
    return " ".join(first.split()[:6])[:60]


# ---------------------------------------------------------------------------------------------
# inspect against the reference


def compare_view(
    info: dict[str, Any], ref_name: str, ref: dict[str, Any], command: str
) -> list[Finding]:
    """Our tensors (keys, dtypes, shapes, strides, offsets, sharing, devices) vs the reference."""
    findings: list[Finding] = []

    def differ(detail: str, message: str) -> None:
        findings.append(Finding(1, "view-differs", command, detail, message))

    selected = info.get("selected") or []
    node = navigate(ref["tree"], selected)
    if node is None:
        differ("selection", f"selected {selected!r} does not exist in {ref_name}'s tree")
        return findings
    theirs = tensor_items(node)
    if not selected and node.get("t") != "dict":
        # A root that is no mapping: inspect lists every tensor of the tree by its path.
        walked = tree_tensors(node)
        if walked is None:  # deeper than the reference describes: nothing to compare
            return findings
        theirs = walked
    ours = info.get("tensors") or []
    our_names = [t["name"] for t in ours]
    their_names = [n for n, _ in theirs]
    # A tensor used as a key (a mutated pickle's) is named by each reader's own str(): torch
    # prints its values, we our descriptor. Both must hold a tensor there; the names match by
    # position instead.
    kinds = [k["type"] for k, v in dict_items(node) if v.get("t") == "tensor"]
    if ref_name != "safetensors" and len(kinds) == len(our_names) == len(their_names):
        for i, kind in enumerate(kinds):
            if kind == "Tensor" and our_names[i].startswith("TensorRef("):
                our_names[i] = their_names[i] = f"<tensor key {i}>"
    if ref_name == "safetensors":
        our_names, their_names = sorted(our_names), sorted(their_names)
    if our_names != their_names:
        differ(
            "keys",
            f"keys differ from {ref_name}: ours {our_names[:6]}... theirs {their_names[:6]}...",
        )
        return findings
    if ref_name == "safetensors":
        ours = sorted(ours, key=lambda t: t["name"])
        theirs = sorted(theirs, key=lambda p: p[0])
    fields = ["dtype", "shape", "stride", "device"]
    if ref_name != "safetensors":
        fields += ["offset", "storage_nbytes"]
    for t, (_, want) in zip(ours, theirs):
        for f in fields:
            if t.get(f) != want.get(f):
                differ(f, f"{t['name']}: {f} ours {t.get(f)!r}, {ref_name} {want.get(f)!r}")
                return findings
    if ref_name != "safetensors":
        mine = partition((n, t["storage"]) for n, t in zip(our_names, ours))
        theirs_p = partition((n, v["storage"]) for n, (_, v) in zip(their_names, theirs))
        if mine != theirs_p:
            differ("sharing", f"storage sharing differs from {ref_name}")
    return findings


def check_inspect(
    ours: dict[str, Any],
    oracle: dict[str, Any] | None,
    mutations: Sequence[str],
    command: str,
    pristine: bool = False,
) -> list[Finding]:
    """``inspect``'s answer (library or CLI) against the references.

    ``ours``: ``{"ok": True, "info": ...}`` or ``{"ok": False, "exit_code": ..., ...}``.
    ``pristine``: the file is an unmutated seed written by torch itself.
    """
    findings: list[Finding] = []
    if oracle is None or "timeout" in oracle or "died" in oracle or "worker_error" in oracle:
        return findings  # the reference itself hung or crashed: no verdict
    if not ours.get("ok"):
        if pristine and ours.get("exit_code") in REFUSALS:
            for name in ("torch", "safetensors"):
                if oracle.get(name, {}).get("ok") and name == "torch":
                    findings.append(
                        Finding(
                            1,
                            "refuses-valid",
                            command,
                            short_error(ours.get("message", "")),
                            "refused a file torch.save wrote and torch loads: "
                            f"{ours.get('message')}",
                        )
                    )
        return findings
    info = ours["info"]
    fmt = info.get("format")
    if fmt == "torchscript":
        torch_error = oracle.get("torch", {}).get("error", "")
        if "TorchScript" not in torch_error:
            findings.append(
                Finding(
                    1,
                    "format",
                    command,
                    "torchscript",
                    f"we say torchscript, torch: {torch_error[:200]}",
                )
            )
        return findings
    if fmt not in TORCH_FORMATS | {"safetensors", "pickle"}:
        return findings
    ref_name, ref = reference(fmt, oracle)
    if fmt == "pickle" and oracle.get("torch", {}).get("ok"):
        findings.append(
            Finding(
                1,
                "format",
                command,
                "pickle-vs-torch",
                "we read a plain pickle, torch a checkpoint",
            )
        )
        return findings
    if ref.get("ok"):
        findings += compare_view(info, ref_name, ref, command)
        return findings
    theirs = unsafe_named(ref)
    if theirs:
        if not covers(info.get("unsafe_globals") or [], theirs):
            findings.append(
                Finding(
                    1,
                    "unsafe-unnamed",
                    command,
                    family(mutations).split(".")[0],
                    f"{ref_name} refuses global(s) {theirs}; we report "
                    f"{info.get('unsafe_globals')} and exit 0",
                )
            )
        return findings
    klass = format_class(mutations)
    findings.append(
        Finding(
            klass,
            "accepts-refused",
            command,
            f"{ref_name}:{family(mutations)}",
            f"{ref_name} refuses this file ({short_error(ref.get('error', ''))}); "
            f"we read it as {fmt} with {len(info.get('tensors') or [])} tensors",
        )
    )
    return findings


def check_scan(answer: dict[str, Any], oracle: dict[str, Any] | None) -> list[Finding]:
    """``ct.scan``'s verdict on the file, against torch's weights-only reading of it.

    It never crashes; where torch's weights-only unpickler names a global it refuses, the
    scan names it too, off the allowlist; where torch loads the file, nothing in the pickle
    torch read (``data.pkl``) is dangerous.
    """
    found = answer.get("scan")
    if not found:
        return []
    if "crash" in found:
        return [
            Finding(
                8,
                "traceback",
                "ct.scan",
                found["crash"],
                f"{found['crash']} (not a verdict): {found.get('message', '')[:200]}",
                {"traceback": found.get("traceback", "")},
            )
        ]
    torch_ref = (oracle or {}).get("torch", {})
    flagged = [f["global"] for f in found["findings"] if f["global"]]
    theirs = unsafe_named(torch_ref)
    if theirs and not covers(flagged, theirs):
        return [
            Finding(
                1,
                "scan-unnamed",
                "ct.scan",
                found["verdict"],
                f"torch refuses global(s) {theirs}; scan says {found['verdict']} with {flagged}",
            )
        ]
    read = [
        f["global"]
        for f in found["findings"]
        if f["severity"] == "dangerous" and f["record"].endswith("/data.pkl")
    ]
    if torch_ref.get("ok") and read and not found["error"]:
        # (Where our reader refuses the archive, records may share a name: torch read one.)
        return [
            Finding(
                1,
                "scan-false-alarm",
                "ct.scan",
                "data.pkl",
                f"torch loads the file with weights_only=True; scan calls {read} dangerous",
            )
        ]
    return []


def check_library_answer(
    answer: dict[str, Any], seconds_bound: float = TIME_BOUND
) -> list[Finding]:
    """The process-level promises for one ``ct.inspect`` call in the sandboxed worker."""
    if answer.get("timeout"):
        return [Finding(8, "hang", "ct.inspect", "timeout", "ct.inspect ran past its time limit")]
    if "died" in answer:
        return [
            Finding(8, "died", "ct.inspect", str(answer["died"]), f"worker died: {answer['died']}")
        ]
    findings = []
    if answer.get("crash"):
        findings.append(
            Finding(
                8,
                "traceback",
                "ct.inspect",
                answer["crash"],
                f"{answer['crash']} (not a CheckpointError): {answer.get('message', '')[:200]}",
                {"traceback": answer.get("traceback", "")},
            )
        )
    elif not answer.get("ok") and answer.get("exit_code") not in DOCUMENTED_EXIT_CODES:
        findings.append(
            Finding(8, "exit-code", "ct.inspect", str(answer.get("exit_code")), str(answer))
        )
    elif not answer.get("ok") and "\n" in answer.get("message", "").strip():
        findings.append(
            Finding(8, "multiline", "ct.inspect", answer.get("error", "?"), answer["message"][:300])
        )
    if answer.get("seconds", 0) > seconds_bound:
        findings.append(Finding(8, "slow", "ct.inspect", "time", f"took {answer['seconds']:.1f} s"))
    if answer.get("torch_imported"):
        findings.append(
            Finding(0, "torch-imported", "ct.inspect", "import", "inspect imported torch")
        )
    return findings
