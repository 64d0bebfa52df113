"""``ckpt scan`` beside picklescan, modelscan, fickling and modelaudit: live payloads, and speed.

Two parts: the verdicts on a corpus of small files (below), and the speed on a folder of
realistic checkpoints (``--realistic N``, further below), where interpreter start-up no
longer dominates as it does on the corpus's tiny files.

The corpus (``tests/helpers/scan_corpus.py``; ``tests/ops/scan/test_scan_corpus.py`` proves every
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

The realistic folder (``--realistic N``, default 8; 0 leaves it out) holds N torch
checkpoints of the shapes people save, 10-40 MB each (about 215 MiB for 8), random data
from fixed seeds, built with torch in the work folder (no download): a ResNet-50 state dict
(torchvision's 320 keys, half width, fp32, ``.pth``), a BERT state dict (Hugging Face keys,
12 layers: 200 entries, hidden 256, fp16, ``pytorch_model.bin``), a trainer dict (model,
Adam state, scheduler, epoch), a Lightning ``.ckpt`` (``model.`` keys, optimizer states,
callbacks, loops), an LSTM language model in the legacy format
(``_use_new_zipfile_serialization=False``), a ViT with DataParallel ``module.`` keys, a
MobileNetV2 state dict saved with ``pickle_protocol=4``, and a Llama-style ``.safetensors``
(bf16); past 8 the kinds repeat with other seeds. First one run per file: ``ckpt scan`` must
call each ``clean`` (exit 0) and picklescan flag none (it skips the ``.safetensors``). Then
every tool named by ``--realistic-tools`` that takes folders (default ckpt, picklescan and
its ``--strict`` row, modelscan, modelaudit; fickling takes no folder) runs on the whole
folder with the argv of the corpus runs (``ckpt scan FOLDER --json``, ``picklescan --path
FOLDER``, ...): one warm-up run each (which also leaves the folder in the page cache for
all), then ``--repeats`` rounds, each tool once a round, the first tool rotating from round
to round. Printed per tool: the median wall time, min-max, median CPU time, the worst peak
RSS (:func:`common.measure`), the ratio to picklescan and the folder verdict. Target:
``ckpt scan`` median <= picklescan median (ratio <= 1.0). The package is byte-compiled
first (``python -m compileall ckpt_tools``, as ``make bytecode``): this machine sets
``PYTHONDONTWRITEBYTECODE``, and without .pyc files every ``ckpt`` start would compile the
package.

The exit status is 1 when a target is missed: a malicious file not ``dangerous``, another
file ``dangerous``, a nonstandard corpus file not ``nonstandard``, a realistic file not
``clean`` or flagged by picklescan, or ckpt scan slower than picklescan on the folder.

Run: ``.venv/bin/python benchmarks/bench_scan.py --scanners-venv /tmp/scanners --repeats 5
--realistic 8`` (``--tools ckpt,picklescan`` to pick tools, ``--realistic-tools
ckpt,picklescan,modelscan`` to leave modelaudit out of the realistic part only,
``--no-fixtures``, ``--no-real``, ``--no-corpus`` for the realistic part alone, ``--repeats
N`` for the whole-folder runs of both parts, ``--keep`` to keep the files, ``--details`` for
the per-file table).
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
from typing import NamedTuple

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
    measure,
    ratio,
    sync_file,
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
    measurement: Measurement | None = None  # wall time, peak RSS, CPU time


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


def _scanner(label: str, version: str, argv, readings, takes_folders: bool = True) -> Tool:
    """A third-party scanner's :class:`Tool`, run with :data:`SCANNER_ENV`."""
    return Tool(label, version, argv, readings, takes_folders=takes_folders, env=SCANNER_ENV)


def _picklescan_tools(script: str, _python: str, version: str) -> list[Tool]:
    """picklescan, and again with ``--strict`` (its "suspicious" globals count as dangerous)."""
    return [
        _scanner(
            label,
            version,
            lambda t, _r, extra=extra: [script, "--path", str(t), *extra],
            {label: picklescan_verdict},
        )
        for label, extra in (("picklescan", []), ("picklescan --strict", ["--strict"]))
    ]


def _modelscan_tools(script: str, _python: str, version: str) -> list[Tool]:
    return [
        _scanner(
            "modelscan",
            version,
            lambda t, r: [script, "-p", str(t), "-r", "json", "-o", str(r)],
            {"modelscan": modelscan_verdict},
        )
    ]


def _fickling_tools(script: str, python: str, version: str) -> list[Tool]:
    """fickling's CLI, and its Hugging Face dispatch through its Python API (no folders)."""
    api_readings = {"fickling-api": fickling_api_verdict, "fickling-api-overt": fickling_api_overt}
    return [
        _scanner(
            "fickling",
            version,
            lambda t, r: [script, "--check-safety", "--json-output", str(r), str(t)],
            {"fickling": by_exit},
            takes_folders=False,
        ),
        _scanner(
            "fickling-api",
            version,
            lambda t, _r: [python, "-c", FICKLING_API, str(t)],
            api_readings,
            takes_folders=False,
        ),
    ]


def _modelaudit_tools(script: str, _python: str, version: str) -> list[Tool]:
    return [
        _scanner(
            "modelaudit",
            version,
            lambda t, _r: [script, "scan", "--format", "json", "--no-cache", str(t)],
            {"modelaudit": modelaudit_critical, "modelaudit-exit": by_exit},
        )
    ]


# Each scanner's console script and distribution name, and its tools (script, python, version).
SCANNERS: dict[str, Callable[[str, str, str], list[Tool]]] = {
    "picklescan": _picklescan_tools,
    "modelscan": _modelscan_tools,
    "fickling": _fickling_tools,
    "modelaudit": _modelaudit_tools,
}


def scanner_tools(venv: Path | None, wanted: Sequence[str]) -> list[Tool]:
    tools: list[Tool] = []
    for name, make_tools in SCANNERS.items():
        if name not in wanted:
            continue
        script = find_script(name, venv)
        if script is None:
            print(f"{name}: not found (in --scanners-venv or on PATH); skipped")
            continue
        python = script_python(script)
        tools += make_tools(str(script), python, dist_version(python, name))
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


# --------------------------------------------------------------------------- realistic folder


@dataclass(frozen=True)
class RealisticFile:
    path: Path
    shape: str  # what it is, in words
    n_tensors: int


# Every builder is ``build(torch, seed) -> (obj, save_kwargs)``, ``save_kwargs`` ``None`` for a
# safetensors file; every tensor is random (seeded), built on the CPU; sizes 10-40 MB. torch is
# passed in, not imported, so that the corpus part runs without importing it.


def _rand(torch, g, *shape, dtype=None):
    t = torch.randn(*shape, generator=g)
    return t.to(dtype) if dtype is not None else t


def _bn(torch, g, sd, name, c):
    sd[f"{name}.weight"] = 1 + 0.1 * _rand(torch, g, c)
    sd[f"{name}.bias"] = 0.1 * _rand(torch, g, c)
    sd[f"{name}.running_mean"] = 0.1 * _rand(torch, g, c)
    sd[f"{name}.running_var"] = torch.rand(c, generator=g) + 0.5
    sd[f"{name}.num_batches_tracked"] = torch.tensor(125_000, dtype=torch.long)


def _conv_bn(torch, g, sd, pre, cout, cin, k, groups=1):
    sd[f"{pre}.0.weight"] = _rand(torch, g, cout, cin // groups, k, k)
    _bn(torch, g, sd, f"{pre}.1", cout)


def _linears(torch, g, sd, pre, layout, dtype=None, bias=True):
    """``{pre}.{name}.weight`` (and ``.bias``) for each ``(name, (out, in))`` of ``layout``."""
    for name, (dout, din) in layout:
        sd[f"{pre}.{name}.weight"] = _rand(torch, g, dout, din, dtype=dtype)
        if bias:
            sd[f"{pre}.{name}.bias"] = _rand(torch, g, dout, dtype=dtype)


def _resnet50(torch, seed, width=0.5):
    # torchvision's resnet50 key layout (320 entries), at half width (a quarter the bytes).
    g, sd = torch.Generator().manual_seed(seed), {}
    c = int(64 * width)
    sd["conv1.weight"] = _rand(torch, g, c, 3, 7, 7)
    _bn(torch, g, sd, "bn1", c)
    inplanes = c
    for li, (blocks, planes) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), 1):
        p = int(planes * width)
        for b in range(blocks):
            pre = f"layer{li}.{b}"
            for j, (cout, cin, k) in enumerate(((p, inplanes, 1), (p, p, 3), (4 * p, p, 1)), 1):
                sd[f"{pre}.conv{j}.weight"] = _rand(torch, g, cout, cin, k, k)
                _bn(torch, g, sd, f"{pre}.bn{j}", cout)
            if b == 0:
                sd[f"{pre}.downsample.0.weight"] = _rand(torch, g, 4 * p, inplanes, 1, 1)
                _bn(torch, g, sd, f"{pre}.downsample.1", 4 * p)
            inplanes = 4 * p
    sd["fc.weight"] = _rand(torch, g, 1000, inplanes)
    sd["fc.bias"] = _rand(torch, g, 1000)
    return sd, {}


def _bert(torch, seed, h=256, layers=12, vocab=30522):
    # Hugging Face BertModel key layout (bert-base: 12 layers, 200 entries), fp16,
    # narrowed to hidden 256 to stay under 40 MB; as saved to pytorch_model.bin.
    g, sd, f16 = torch.Generator().manual_seed(seed), {}, torch.float16
    e = "bert.embeddings"
    sd[f"{e}.position_ids"] = torch.arange(512).unsqueeze(0)
    sd[f"{e}.word_embeddings.weight"] = _rand(torch, g, vocab, h, dtype=f16)
    sd[f"{e}.position_embeddings.weight"] = _rand(torch, g, 512, h, dtype=f16)
    sd[f"{e}.token_type_embeddings.weight"] = _rand(torch, g, 2, h, dtype=f16)
    sd[f"{e}.LayerNorm.weight"] = torch.ones(h, dtype=f16)
    sd[f"{e}.LayerNorm.bias"] = torch.zeros(h, dtype=f16)
    attention = [(f"attention.self.{n}", (h, h)) for n in ("query", "key", "value")]
    layout = [
        *attention,
        ("attention.output.dense", (h, h)),
        ("intermediate.dense", (4 * h, h)),
        ("output.dense", (h, 4 * h)),
    ]
    for i in range(layers):
        pre = f"bert.encoder.layer.{i}"
        _linears(torch, g, sd, pre, layout, dtype=f16)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            sd[f"{pre}.{ln}.weight"] = 1 + _rand(torch, g, h, dtype=f16) / 10
            sd[f"{pre}.{ln}.bias"] = _rand(torch, g, h, dtype=f16) / 10
    _linears(torch, g, sd, "bert.pooler", [("dense", (h, h))], dtype=f16)
    return sd, {}


def _adam_after_steps(torch, model, steps=3):
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    for _ in range(steps):
        for prm in model.parameters():
            prm.grad = torch.randn_like(prm)
        opt.step()
        sched.step()
    return opt, sched


def _trainer(torch, seed):
    # A training script's checkpoint: {model, optimizer (Adam), scheduler, epoch, ...}.
    torch.manual_seed(seed)
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    model = nn.Sequential(
        nn.TransformerEncoder(layer, 3, enable_nested_tensor=False), nn.Linear(256, 1000)
    )
    opt, sched = _adam_after_steps(torch, model)
    obj = {
        "epoch": 7,
        "global_step": 7000,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "best_val_loss": 1.2345,
        "config": {"lr": 3e-4, "batch_size": 64, "layers": 3, "d_model": 256},
    }
    return obj, {}


_LIGHTNING_PATH = "/runs/exp1/checkpoints/epoch=4-step=1234.ckpt"
_LIGHTNING_MC = (
    "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, "
    "'every_n_epochs': 1, 'train_time_interval': None}"
)
_LIGHTNING_PROGRESS = {"ready": 5, "started": 5, "processed": 5, "completed": 4}


def _lightning_callbacks(score) -> dict:
    """Lightning's ModelCheckpoint and EarlyStopping states, ``score`` their best score."""
    path = _LIGHTNING_PATH
    return {
        _LIGHTNING_MC: {
            "monitor": "val_loss",
            "best_model_score": score,
            "best_model_path": path,
            "current_score": score,
            "dirpath": "/runs/exp1/checkpoints",
            "best_k_models": {path: score},
            "kth_best_model_path": path,
            "kth_value": score,
            "last_model_path": "",
        },
        "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}": {
            "wait_count": 0,
            "stopped_epoch": 0,
            "best_score": score,
            "patience": 3,
        },
    }


def _lightning(torch, seed):
    # PyTorch Lightning's ModelCheckpoint layout ("model." keys, callbacks, loops ...).
    torch.manual_seed(seed)
    nn = torch.nn
    convs: list = []
    for cin, cout in ((3, 64), (64, 128), (128, 256), (256, 512)):
        convs += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    model = nn.Sequential(*convs, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))
    opt, sched = _adam_after_steps(torch, model)
    fit_loop = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": 1234},
        "epoch_progress": {
            "total": dict(_LIGHTNING_PROGRESS),
            "current": dict(_LIGHTNING_PROGRESS),
        },
    }
    obj = {
        "epoch": 4,
        "global_step": 1234,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "loops": {"fit_loop": fit_loop},
        "callbacks": _lightning_callbacks(torch.tensor(0.4321)),
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 3e-4, "num_classes": 1000, "widths": [64, 128, 256, 512]},
    }
    return obj, {}


def _lstm_legacy(torch, seed):
    # word_language_model-style LSTM, saved in torch's pre-1.6 (non-zip) format.
    torch.manual_seed(seed)
    nn = torch.nn

    class RNNModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Embedding(3000, 400)
            self.rnn = nn.LSTM(400, 512, 2)
            self.decoder = nn.Linear(512, 3000)

    return RNNModel().state_dict(), {"_use_new_zipfile_serialization": False}


def _vit_dataparallel(torch, seed, h=384, blocks=4):
    # timm ViT-S/16 key layout, first 4 blocks, saved from nn.DataParallel ("module.").
    g, sd = torch.Generator().manual_seed(seed), {}
    sd["cls_token"] = _rand(torch, g, 1, 1, h)
    sd["pos_embed"] = _rand(torch, g, 1, 197, h)
    sd["patch_embed.proj.weight"] = _rand(torch, g, h, 3, 16, 16)
    sd["patch_embed.proj.bias"] = _rand(torch, g, h)
    layout = [
        ("attn.qkv", (3 * h, h)),
        ("attn.proj", (h, h)),
        ("mlp.fc1", (4 * h, h)),
        ("mlp.fc2", (h, 4 * h)),
    ]
    for i in range(blocks):
        pre = f"blocks.{i}"
        _linears(torch, g, sd, pre, layout)
        for norm in ("norm1", "norm2"):
            sd[f"{pre}.{norm}.weight"] = torch.ones(h)
            sd[f"{pre}.{norm}.bias"] = torch.zeros(h)
    sd["norm.weight"], sd["norm.bias"] = torch.ones(h), torch.zeros(h)
    sd["head.weight"], sd["head.bias"] = _rand(torch, g, 1000, h), _rand(torch, g, 1000)
    return {f"module.{k}": v for k, v in sd.items()}, {}


# torchvision's mobilenet_v2 inverted residual settings: (expansion, channels, blocks).
_MOBILENET_V2_BLOCKS = ((1, 16, 1), (6, 24, 2), (6, 32, 3), (6, 64, 4), (6, 96, 3), (6, 160, 3))


def _mobilenet_v2_proto4(torch, seed):
    # torchvision's mobilenet_v2 key layout (314 entries), saved with pickle_protocol=4.
    g, sd = torch.Generator().manual_seed(seed), {}
    _conv_bn(torch, g, sd, "features.0", 32, 3, 3)
    cin, idx = 32, 1
    for t, c, n in _MOBILENET_V2_BLOCKS:
        for _ in range(n):
            hid, pre, j = cin * t, f"features.{idx}.conv", 0
            if t != 1:
                _conv_bn(torch, g, sd, f"{pre}.0", hid, cin, 1)
                j = 1
            _conv_bn(torch, g, sd, f"{pre}.{j}", hid, hid, 3, groups=hid)
            sd[f"{pre}.{j + 1}.weight"] = _rand(torch, g, c, hid, 1, 1)
            _bn(torch, g, sd, f"{pre}.{j + 2}", c)
            cin, idx = c, idx + 1
    hid, pre = cin * 6, f"features.{idx}.conv"
    _conv_bn(torch, g, sd, f"{pre}.0", hid, cin, 1)
    _conv_bn(torch, g, sd, f"{pre}.1", hid, hid, 3, groups=hid)
    sd[f"{pre}.2.weight"] = _rand(torch, g, 320, hid, 1, 1)
    _bn(torch, g, sd, f"{pre}.3", 320)
    _conv_bn(torch, g, sd, f"features.{idx + 1}", 1280, 320, 1)
    sd["classifier.1.weight"] = _rand(torch, g, 1000, 1280)
    sd["classifier.1.bias"] = _rand(torch, g, 1000)
    return sd, {"pickle_protocol": 4}


def _llama_safetensors(torch, seed, h=384, inter=1024, layers=6, vocab=8000):
    # Hugging Face LlamaForCausalLM key layout, bf16, as model.safetensors.
    g, sd, bf16 = torch.Generator().manual_seed(seed), {}, torch.bfloat16
    sd["model.embed_tokens.weight"] = _rand(torch, g, vocab, h, dtype=bf16)
    attention = [(f"self_attn.{n}_proj", (h, h)) for n in "qkvo"]
    mlp = [
        ("mlp.gate_proj", (inter, h)),
        ("mlp.up_proj", (inter, h)),
        ("mlp.down_proj", (h, inter)),
    ]
    for i in range(layers):
        pre = f"model.layers.{i}"
        _linears(torch, g, sd, pre, attention + mlp, dtype=bf16, bias=False)
        sd[f"{pre}.input_layernorm.weight"] = torch.ones(h, dtype=bf16)
        sd[f"{pre}.post_attention_layernorm.weight"] = torch.ones(h, dtype=bf16)
    sd["model.norm.weight"] = torch.ones(h, dtype=bf16)
    sd["lm_head.weight"] = _rand(torch, g, vocab, h, dtype=bf16)
    return sd, None


class RealisticKind(NamedTuple):
    name: str  # the file name
    shape: str  # what it is, in words
    build: Callable  # (torch, seed) -> (obj, save_kwargs); save_kwargs None: safetensors


# In folder order; past the last, the kinds repeat with other seeds.
REALISTIC_KINDS = (
    RealisticKind(
        "resnet50_w05.pth", "ResNet-50 state dict (torchvision keys, half width), fp32", _resnet50
    ),
    RealisticKind(
        "pytorch_model.bin", "BERT state dict (HF keys, 12 layers, hidden 256), fp16", _bert
    ),
    RealisticKind(
        "trainer_epoch7.pt", "trainer dict: Transformer model + Adam + scheduler", _trainer
    ),
    RealisticKind(
        "lightning_epoch4.ckpt", "Lightning checkpoint: CNN + Adam + callbacks", _lightning
    ),
    RealisticKind(
        "lstm_lm_legacy.pt", "LSTM language model, legacy (non-zip) format", _lstm_legacy
    ),
    RealisticKind(
        "vit_dataparallel.pth", "ViT-S (4 blocks), DataParallel module. keys", _vit_dataparallel
    ),
    RealisticKind(
        "mobilenet_v2_p4.pt", "MobileNetV2 state dict, pickle_protocol=4", _mobilenet_v2_proto4
    ),
    RealisticKind(
        "model.safetensors", "Llama-style (6 layers, hidden 384), bf16", _llama_safetensors
    ),
)


def count_tensors(torch, obj) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(torch, v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(torch, v) for v in obj)
    return 0


def build_realistic(folder: Path, n: int) -> list[RealisticFile]:
    """``n`` realistic checkpoints in ``folder``: the kinds of :data:`REALISTIC_KINDS` in
    turn (past the eighth, again with another seed), each written and fsynced."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    kinds = REALISTIC_KINDS
    out = []
    for i in range(n):
        name, shape, build = kinds[i % len(kinds)]
        obj, kwargs = build(torch, 1000 + i)
        path = folder / (name if i < len(kinds) else f"r{i // len(kinds)}_{name}")
        if kwargs is None:
            save_file(obj, str(path), metadata={"format": "pt"})
        else:
            torch.save(obj, str(path), **kwargs)
        sync_file(path)
        out.append(RealisticFile(path, shape, count_tensors(torch, obj)))
        del obj
    return out


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
    return Run(m.returncode, text, report_text, m.wall_s, m)


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


def compile_package() -> None:
    """``make bytecode`` for the package: this machine sets PYTHONDONTWRITEBYTECODE, and an
    editable checkout without .pyc files would compile every module at every start."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(REPO / "ckpt_tools")],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def realistic_checks(
    tools: list[Tool], files: list[RealisticFile], scratch: Path
) -> list[tuple[bool, str]]:
    """One run of ckpt scan and picklescan per realistic file: ckpt scan must call each
    clean (exit 0), picklescan (without --strict) must flag none."""
    checks = []
    for tool in tools:
        if tool.name not in ("ckpt scan", "picklescan"):
            continue
        read = next(iter(tool.readings.values()))
        marks = {f.path.name: read(run_one(tool, f.path, scratch)) for f in files}
        if tool.name == "ckpt scan":
            bad = [f"{name} ({m})" for name, m in marks.items() if m != CLEAN]
            checks.append(
                (
                    not bad,
                    f"ckpt scan: realistic files clean: {len(files) - len(bad)}/{len(files)}"
                    + (f" (not: {', '.join(bad)})" if bad else ""),
                )
            )
        else:
            bad = [f"{name} ({m})" for name, m in marks.items() if m in (FLAGGED, ERROR)]
            skipped = sum(m == SKIPPED for m in marks.values())
            checks.append(
                (
                    not bad,
                    f"picklescan: realistic files flagged or failed: {len(bad)} (target: 0;"
                    f" {skipped} not scanned)" + (f" ({', '.join(bad)})" if bad else ""),
                )
            )
    return checks


def time_folder(
    tools: list[Tool], folder: Path, scratch: Path, repeats: int
) -> tuple[dict[str, Summary], dict[str, Run]]:
    """One warm-up run of each tool on ``folder`` (which also warms the page cache for all),
    then ``repeats`` rounds, each tool once a round, the first tool rotating round by round.
    Returns the timed runs' :class:`Summary` and the warm-up run (for the verdict) per tool."""
    warm = {t.name: run_one(t, folder, scratch) for t in tools}
    summaries = {t.name: Summary(t.name) for t in tools}
    for r in range(repeats):
        k = r % len(tools)
        for tool in tools[k:] + tools[:k]:
            run = run_one(tool, folder, scratch)
            assert run.measurement is not None
            summaries[tool.name].add(run.measurement)
            if run.returncode != warm[tool.name].returncode:
                print(
                    f"  note: {tool.name} exited {run.returncode} (warm-up: "
                    f"{warm[tool.name].returncode})"
                )
        print(f"  round {r + 1}/{repeats} done", flush=True)
    return summaries, warm


def realistic_rows(
    tools: list[Tool], summaries: dict[str, Summary], warm: dict[str, Run]
) -> list[list[str]]:
    base = summaries.get("picklescan")
    rows = []
    for tool in tools:
        s = summaries[tool.name]
        verdicts = ", ".join(read(warm[tool.name]) for read in tool.readings.values())
        rows.append(
            [
                tool.name,
                tool.version,
                f"{s.wall_s:.3f}",
                s.spread,
                f"{s.cpu_s:.3f}",
                f"{s.peak_rss_mb:.1f}",
                ratio(s.wall_s, base.wall_s) if base else "n/a",
                f"{verdicts} (exit {warm[tool.name].returncode})",
            ]
        )
    return rows


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--scanners-venv", type=Path, default=None)
    parser.add_argument(
        "--tools", default="ckpt,picklescan,modelscan,fickling,modelaudit", help="comma list"
    )
    parser.add_argument("--no-fixtures", action="store_true")
    parser.add_argument("--no-real", action="store_true")
    parser.add_argument("--no-corpus", action="store_true", help="only the realistic folder")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed whole-folder runs per tool (corpus, realistic)",
    )
    parser.add_argument(
        "--realistic",
        type=int,
        default=8,
        metavar="N",
        help="realistic checkpoints (10-40 MB each) in the speed folder; 0: no such folder",
    )
    parser.add_argument(
        "--realistic-tools",
        default="ckpt,picklescan,modelscan,modelaudit",
        help="comma list of the --tools timed on the realistic folder (fickling takes no folder)",
    )
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--details", action="store_true", help="print the per-file table")
    return parser.parse_args(argv)


def comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def select_tools(args: argparse.Namespace) -> list[Tool]:
    """ckpt scan (when asked for and available), then the scanners asked for and found."""
    wanted = comma_list(args.tools)
    ckpt = ckpt_tool() if "ckpt" in wanted else None
    return ([ckpt] if ckpt else []) + scanner_tools(args.scanners_venv, wanted)


def corpus_part(
    args: argparse.Namespace, tools: list[Tool], root: Path, scratch: Path
) -> list[Item] | None:
    """Build the corpus and run every tool on it; ``None`` when a payload ran."""
    folder, markers = root / "files", Path(tempfile.mkdtemp(prefix="markers-", dir=root))
    folder.mkdir()
    items = build_items(folder, markers, not args.no_fixtures, not args.no_real)
    counts = {g: sum(i.group == g for i in items) for g in GROUPS}
    print(f"corpus: {len(items)} files {counts} in {folder}")
    run_all(tools, items, folder, scratch, args.repeats)
    ran = sorted(p.name for p in markers.iterdir())
    if ran:
        print(f"FAIL: a payload ran during the scans (markers {ran})")
        return None
    print("no payload ran during the scans (the markers folder is empty)")
    print(load_note())
    return items


@dataclass
class RealisticResult:
    """What the realistic part measured, for :func:`report_realistic`."""

    files: list[RealisticFile]
    size: int  # bytes in all
    timed: list[Tool]
    summaries: dict[str, Summary]
    warm: dict[str, Run]
    checks: list[tuple[bool, str]]


def realistic_part(
    args: argparse.Namespace, tools: list[Tool], root: Path, scratch: Path
) -> RealisticResult:
    """Build the realistic folder, check each file's verdict, time the folder tools on it."""
    realistic_wanted = set(comma_list(args.realistic_tools))
    timed = [
        t
        for t in tools
        if t.takes_folders
        and t.name.split()[0] in realistic_wanted  # "ckpt scan", "picklescan --strict"
    ]
    real_folder = root / "realistic"
    files = build_realistic(real_folder, args.realistic)
    size = sum(f.path.stat().st_size for f in files)
    print(f"\nrealistic folder: {len(files)} files, {size / MIB:.1f} MiB in {real_folder}")
    print(
        fmt_table(
            [
                [f.path.name, f.shape, f.n_tensors, f"{f.path.stat().st_size / MIB:.1f}"]
                for f in files
            ],
            ["file", "what", "tensors", "MiB"],
        )
    )
    checks = realistic_checks(tools, files, scratch)
    print(f"timing {', '.join(t.name for t in timed)} on it: 1 warm-up + {args.repeats}")
    summaries, warm = time_folder(timed, real_folder, scratch, args.repeats)
    print(load_note())
    return RealisticResult(files, size, timed, summaries, warm, checks)


CORPUS_HEADERS = [
    "tool",
    "version",
    *(f"{g} flagged" for g in GROUPS),
    "errors",
    "skipped",
    "corpus s",
    "vs ckpt",
    "per file s",
]
REALISTIC_HEADERS = [
    "tool",
    "version",
    "median s",
    "min-max",
    "cpu s",
    "peak RSS MB",
    "vs picklescan",
    "folder verdict",
]


def report_corpus(tools: list[Tool], items: list[Item], details: bool) -> list[tuple[bool, str]]:
    """Print the corpus tables and misses; return ckpt scan's targets."""
    print()
    print(fmt_table(summary_rows(tools, items), CORPUS_HEADERS))
    print(
        "\nflagged = the tool's verdict (see the docstring); corpus s = one run on the whole "
        "folder (fickling: the sum of its per-file runs); per file s = median per-file run."
    )
    print()
    print("\n".join(misses(tools, items)))
    if details:
        labels = [label for t in tools for label in t.readings]
        print()
        print(fmt_table(detail_rows(tools, items), ["file", "group", *labels]))
    return ckpt_targets(tools, items)


def report_realistic(result: RealisticResult, repeats: int) -> list[tuple[bool, str]]:
    """Print the realistic folder's table; return its targets."""
    print(
        f"\nrealistic folder ({len(result.files)} files, {result.size / MIB:.0f} MiB, warm page "
        f"cache), median of {repeats} interleaved rounds after a warm-up run each:"
    )
    print(fmt_table(realistic_rows(result.timed, result.summaries, result.warm), REALISTIC_HEADERS))
    targets = list(result.checks)
    summaries = result.summaries
    if "ckpt scan" in summaries and "picklescan" in summaries:
        ours, theirs = summaries["ckpt scan"].wall_s, summaries["picklescan"].wall_s
        targets.append(
            (
                ours <= theirs,
                f"ckpt scan / picklescan on the realistic folder: {ours / theirs:.2f}x "
                f"({ours:.3f} s / {theirs:.3f} s, medians; target <= 1.0x)",
            )
        )
    return targets


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    compile_package()
    print(machine_note())
    print(load_note())
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    tools = select_tools(args)
    items: list[Item] = []
    realistic = None
    with workdir(args.workdir, keep=args.keep) as root:
        scratch = root / "scratch"
        scratch.mkdir()
        if not args.no_corpus:
            corpus = corpus_part(args, tools, root, scratch)
            if corpus is None:
                return 1
            items = corpus
        if args.realistic > 0:
            realistic = realistic_part(args, tools, root, scratch)
    targets: list[tuple[bool, str]] = []
    if items:
        targets += report_corpus(tools, items, args.details)
    if realistic is not None:
        targets += report_realistic(realistic, args.repeats)
    print()
    for ok, line in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {line}")
    return 0 if all(ok for ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
