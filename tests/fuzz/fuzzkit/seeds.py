"""Seed inputs: small real checkpoints of every format, built here, plus the committed fixtures.

Each seed is repeatable byte for byte (fixed torch seeds; the legacy writer of
``fixtures/make_fixtures.py`` names storages 0, 1 ...), so a fixed hypothesis seed replays the
same inputs. Hostile seeds carry a REDUCE payload that would create the file named by the
environment variable ``CKPT_FUZZ_MARKER`` if anything ever ran it.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import os
import pickle
import sys
import tempfile
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

from . import pickleops as po

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "fixtures"
MARKER_ENV = "CKPT_FUZZ_MARKER"
SHELL_PAYLOAD = 'touch "${CKPT_FUZZ_MARKER:-/tmp/ckpt-fuzz-pwned}"'
PY_PAYLOAD = (
    "import os; open(os.environ.get('CKPT_FUZZ_MARKER', '/tmp/ckpt-fuzz-pwned'), 'w').close()"
)
# Fixture files the fuzzer starts from (folders and non-checkpoints left out).
FIXTURE_SUFFIXES = (".pt", ".safetensors", ".ckpt", ".pkl", ".bin")


@dataclass(frozen=True)
class Seed:
    name: str
    kind: str  # zip | legacy | tar | safetensors | pickle | torchscript | other
    data: bytes

    @property
    def ext(self) -> str:
        return ".safetensors" if self.kind == "safetensors" else ".pt"


class ShellPayload:
    """Pickles as ``os.system(SHELL_PAYLOAD)`` (``posix.system`` on disk)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (SHELL_PAYLOAD,))


class ExecPayload:
    """Pickles as ``builtins.exec(PY_PAYLOAD)``."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.exec, (PY_PAYLOAD,))


@cache
def make_fixtures() -> ModuleType:
    """``fixtures/make_fixtures.py`` (torch and the standard library only)."""
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_fixtures", module)
    spec.loader.exec_module(module)
    return module


def kind_of(data: bytes) -> str:
    """A guess at the format, for choosing structure-aware mutators (not a verdict)."""
    if data[:4] == b"PK\x03\x04" or b"PK\x05\x06" in data[-(1 << 16) :]:
        return "zip"
    if len(data) > 262 and data[257:262] == b"ustar":
        return "tar"
    if data[:1] == b"\x80" and b"j\xa8P\x19" in data[:24]:  # the legacy magic number
        return "legacy"
    if data[:1] == b"\x80" or data[:1] in (b"(", b"}", b"]"):
        return "pickle"
    if len(data) >= 10 and data[8:9] == b"{":
        return "safetensors"
    return "other"


def _torch_zip(obj: Any, **kwargs: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    return buffer.getvalue()


def _wrapped_sd(seed: int = 0) -> dict[str, Any]:
    import torch

    torch.manual_seed(seed)
    weight = torch.randn(4, 3)
    return {
        "module.fc.weight": weight,
        "module.fc.bias": torch.randn(4),
        "module.fc_t": weight.t(),
        "module.head.weight": torch.randn(2, 4).half(),
        "module.bn.num_batches_tracked": torch.tensor(3),
    }


def _deflated(data: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            record = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            record.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(record, zin.read(info))
    return out.getvalue()


def _retag_zip(data: bytes, old: str, new: str) -> bytes:
    """The zip with every device location string ``old`` in data.pkl replaced by ``new``."""
    from . import zipfmt

    model = zipfmt.parse_zip(data)
    assert model is not None
    entry = model.data_pkl()
    assert entry is not None
    parsed = po.parse(entry.payload())
    assert parsed is not None
    ops, _ = parsed
    for o in ops:
        if o[0] in po.STR_OPS and o[1] == old:
            o[1], o[2] = new, None
    entry.set_payload(po.assemble(ops))
    return zipfmt.build_zip(model)


def _tar_bytes(obj: Any) -> bytes:
    tools = make_fixtures()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.pt"
        tools.write_torch_tar(path, tools.tar_records(obj))
        return path.read_bytes()


def _safetensors(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata=metadata)


@cache
def built_seeds() -> tuple[Seed, ...]:
    """Small checkpoints of each format and layout ckpt reads."""
    import torch
    from torch import nn

    tools = make_fixtures()
    sd = _wrapped_sd()
    torch.manual_seed(1)
    nested = {
        "model": OrderedDict(sd),
        "optimizer": {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(4, 3)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "epoch": 2,
    }
    torch.manual_seed(2)
    int_keys = {0: torch.randn(2), "0": torch.randn(3), "module.a": torch.arange(4)}
    torch.manual_seed(3)
    linear = nn.Linear(2, 2)
    odd_keys = {0: torch.ones(2), "0": torch.zeros(3), (1, 2): torch.ones(1), b"k": torch.ones(1)}
    odd_keys.update({None: torch.ones(1), "module.a": torch.arange(3)})

    plain_zip = _torch_zip(sd)
    seeds = [
        Seed("zip-plain", "zip", plain_zip),
        Seed("zip-nested", "zip", _torch_zip(nested)),
        Seed("zip-tied", "zip", _torch_zip(tools.tied_and_views())),
        Seed("zip-dtypes", "zip", _torch_zip(tools.mixed_dtypes())),
        Seed("zip-evil-beside", "zip", _torch_zip({"state_dict": sd, "payload": ShellPayload()})),
        Seed("zip-evil-inside", "zip", _torch_zip({**sd, "module.x": ExecPayload()})),
        Seed("zip-int-keys", "zip", _torch_zip(int_keys)),
        Seed("zip-odd-keys", "zip", _torch_zip(odd_keys)),
        Seed("zip-proto4", "zip", _torch_zip(sd, pickle_protocol=4)),
        Seed("zip-proto5", "zip", _torch_zip(sd, pickle_protocol=5)),
        Seed("zip-deflated", "zip", _deflated(plain_zip)),
        Seed("zip-cuda", "zip", _retag_zip(_torch_zip(tools.tied_and_views()), "cpu", "cuda:1")),
        Seed("zip-param", "zip", _torch_zip({"module.w": nn.Parameter(torch.ones(2, 2))})),
        Seed("zip-whole-module", "zip", _torch_zip(linear)),
        Seed("legacy-plain", "legacy", tools.legacy_bytes(sd)),
        Seed("legacy-tied", "legacy", tools.legacy_bytes(tools.tied_and_views())),
        Seed("legacy-py2", "legacy", tools.legacy_bytes({"state_dict": sd}, py2_strings=True)),
        Seed("legacy-evil", "legacy", tools.legacy_bytes({"sd": sd, "x": ShellPayload()})),
        Seed("tar-plain", "tar", _tar_bytes({"state_dict": tools.tied_and_views(), "epoch": 1})),
        Seed("tar-evil", "tar", _tar_bytes({"state_dict": sd, "x": ShellPayload()})),
        Seed("st-plain", "safetensors", _safetensors(sd_contig(sd), {"format": "pt"})),
        Seed("st-dtypes", "safetensors", _safetensors(tools.mixed_dtypes())),
        Seed("pickle-numbers", "pickle", pickle.dumps({"a": 1, "b": [1.5, "x"]}, protocol=2)),
        Seed("pickle-evil", "pickle", pickle.dumps({"a": ShellPayload()}, protocol=2)),
    ]
    return tuple(seeds)


def sd_contig(sd: dict[str, Any]) -> dict[str, Any]:
    """Distinct contiguous copies (safetensors refuses shared or strided tensors)."""
    return {k: v.contiguous().clone() for k, v in sd.items()}


@cache
def fixture_seeds() -> tuple[Seed, ...]:
    found = []
    for path in sorted(FIXTURES.iterdir()):
        if path.is_file() and path.suffix in FIXTURE_SUFFIXES:
            data = path.read_bytes()
            kind = "torchscript" if path.name == "torchscript.pt" else kind_of(data)
            found.append(Seed(f"fixture-{path.name}", kind, data))
    return tuple(found)


def all_seeds() -> tuple[Seed, ...]:
    return built_seeds() + fixture_seeds()
