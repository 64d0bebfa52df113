"""``--dry-run`` on consolidate, sanitize, reshard and convert to a
folder, and ``--ema`` / ``extract`` on a pickled Ultralytics-style ``ema`` module.

Every dry run is checked against the real run that follows it: the files, keys, dtypes, shapes
and sizes it planned are what torch.load / safetensors (the oracles) read from the real output.
The folder is compared byte for byte and by listing before and after each dry run, and each
refusal exits with the real run's code.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import ckpt_tools as ct
from ckpt_tools.cli.main import cli, main
from ckpt_tools.ops.consolidate.consolidation import consolidate
from ckpt_tools.ops.transform.reshard import convert_to_folder, reshard

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CKPT = str(Path(sys.executable).with_name("ckpt"))
TORCH_DTYPES = {
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "BOOL": "bool",
}


class Unlisted:
    """A class no allowlist names: the restricted unpickler never imports it."""

    def __init__(self) -> None:
        self.value = 3


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own folder (relative paths, as users type them)."""
    monkeypatch.chdir(tmp_path)


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` (folders too) and every file's bytes."""
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(folder.rglob("*"))
    }


def _dry_run_then_write(
    args: list[str], folder: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``ckpt ARGS --dry-run`` changes nothing in ``folder``, then ``ckpt ARGS`` exits with the
    same code and the same stderr; returns that ``(code, stderr)``."""
    before = _snapshot(folder)
    dry = main([*args, "--dry-run"])
    dry_err = capsys.readouterr().err
    assert _snapshot(folder) == before, (args, dry_err)
    real = main(args)
    real_err = capsys.readouterr().err
    assert dry == real, (args, dry_err, real_err)
    assert dry_err == real_err
    return dry, dry_err


def _dcp(folder: Path) -> Path:
    """A DCP folder saved by torch in this process: a model, a nested entry, a step."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    state = {
        "model": {
            "embed.weight": torch.randn(7, 4),
            "fc.weight": torch.randn(3, 8, dtype=torch.bfloat16),
            "fc.bias": torch.randn(3),
            "counts": torch.arange(6),
            "mask": torch.tensor([True, False, True]),
        },
        "extra": {"grid": torch.randn(6, 10, dtype=torch.float16)},
        "step": 3,
    }
    with warnings.catch_warnings():  # (saving without a process group warns)
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def _flat(node: Any, name: str = "") -> dict[str, torch.Tensor]:
    if isinstance(node, torch.Tensor):
        return {name: node}
    if isinstance(node, dict):
        return {
            k: v
            for key, val in node.items()
            for k, v in _flat(val, f"{name}.{key}" if name else str(key)).items()
        }
    return {}


def _safetensors_rows(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, nbytes), read by safetensors itself."""
    rows = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
            t = f.get_tensor(key)
            rows[key] = (
                str(t.dtype).removeprefix("torch."),
                tuple(t.shape),
                t.numel() * t.element_size(),
            )
    return rows


def _planned_rows(planned: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    return {t["key"]: (t["dtype"], tuple(t["shape"]), t["nbytes"]) for t in planned["tensors"]}


def _dry_json(args: list[str]) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [*args, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["written"] == [] and data["dry_run"] is True
    return data


# --- consolidate ---------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["m.pt", "m.safetensors", "hf/"])
def test_consolidate_dry_run_plans_exactly_what_the_write_writes(tmp_path: Path, out: str) -> None:
    src = _dcp(tmp_path / "run")
    extra = ["--all"] if out == "m.pt" else ["--max-shard-size", "100"] if out == "hf/" else []
    before = _snapshot(tmp_path)
    data = _dry_json(["consolidate", "run", out, *extra])
    assert _snapshot(tmp_path) == before  # no file, no temp file, no folder
    text = CliRunner().invoke(cli, ["consolidate", "run", out, *extra, "--dry-run"]).output
    assert text.startswith("dry run: would consolidate") and "nothing written" in text
    assert _snapshot(tmp_path) == before

    real = consolidate(
        src,
        out,
        include_all=bool(extra) and out == "m.pt",
        max_shard_size=100 if out == "hf/" else None,
    )
    assert real.written and [f["name"] for f in data["planned_files"]] == list(real.written)
    assert data["tensors"] == real.tensors and data["bytes_written"] == real.bytes_written
    for planned in data["planned_files"]:
        path = Path(planned["name"])
        if path.name.endswith(".index.json"):
            assert planned["nbytes"] == path.stat().st_size
            index = json.loads(path.read_text())
            assert index["metadata"]["total_size"] == data["planned_bytes"]
            continue
        if path.suffix == ".safetensors":
            assert _safetensors_rows(path) == _planned_rows(planned)
        else:
            loaded = _flat(torch.load(path, weights_only=True))
            got = {
                k: (str(t.dtype)[6:], tuple(t.shape), t.numel() * t.element_size())
                for k, t in loaded.items()
            }
            assert list(got.items()) == list(_planned_rows(planned).items())
        assert planned["nbytes"] == sum(r[2] for r in _planned_rows(planned).values())
    if out == "hf/":
        assert len(data["planned_files"]) > 2  # shards and the index
        names = [t["key"] for f in data["planned_files"] for t in f["tensors"]]
        assert sorted(names) == sorted(
            json.loads(Path("hf/model.safetensors.index.json").read_text())["weight_map"]
        )


def test_consolidate_dry_run_refuses_with_the_write_s_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _dcp(tmp_path / "run")
    Path("taken.safetensors").write_bytes(b"x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model-00001-of-00009.safetensors").write_bytes(b"stale")
    cases = [
        ["consolidate", "run", "taken.safetensors"],  # exists: 6
        ["consolidate", "run", "hf/", "--max-shard-size", "100"],  # a stale shard: 6
        ["consolidate", "run", "nowhere/deep/"],  # no parent: 6
        ["consolidate", str(FIXTURES / "plain.pt"), "x.pt"],  # not DCP: 2
        ["consolidate", "run", "x.pt", "--select", "nope"],  # no such entry
    ]
    for args in cases:
        got, err = _dry_run_then_write(args, tmp_path, capsys)
        assert got != 0, (args, err)
    assert main(["consolidate", "run", "taken.safetensors", "--force", "--dry-run"]) == 0
    assert Path("taken.safetensors").read_bytes() == b"x"


def test_consolidate_dry_run_in_a_real_process(tmp_path: Path) -> None:
    _dcp(tmp_path / "run")
    before = _snapshot(tmp_path)
    run = subprocess.run(
        [CKPT, "consolidate", "run", "hf/", "--max-shard-size", "100", "--dry-run", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    # embed 7x4 f32, fc.weight 3x8 bf16, fc.bias 3 f32, counts 6 i64, mask 3 bool
    assert json.loads(run.stdout)["planned_bytes"] == 112 + 48 + 12 + 48 + 3
    assert _snapshot(tmp_path) == before


# --- sanitize ------------------------------------------------------------------------------


def _messy(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    sd = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3)}
    sd["tied"] = sd["fc.weight"]
    torch.save(
        {
            "model": sd,
            "args": argparse.Namespace(lr=0.1, name="run"),
            "mean": np.arange(6, dtype=np.float32).reshape(2, 3),
            "step": np.int64(5),
            "odd": Unlisted(),
        },
        path,
    )
    return sd


def test_sanitize_dry_run_plans_exactly_what_the_write_writes(tmp_path: Path) -> None:
    _messy(tmp_path / "in.pt")
    before = _snapshot(tmp_path)
    data = _dry_json(["sanitize", "in.pt", "out.pt"])
    text = CliRunner().invoke(cli, ["sanitize", "in.pt", "out.pt", "--dry-run"]).output
    assert _snapshot(tmp_path) == before
    assert (
        "dry run: would sanitize" in text
        and "odd: " in text
        and "args: argparse.Namespace -> dict" in text
    )

    real = ct.sanitize("in.pt", "out.pt")
    assert [c.to_json() for c in real.converted] == data["converted"]
    assert [c.to_json() for c in real.dropped_values] == data["dropped_values"]
    assert list(real.dropped) == data["dropped"] and len(data["dropped"]) == 1
    assert (data["bytes_copied"], data["bytes_written"]) == (real.bytes_copied, real.bytes_written)
    assert (
        data["bytes_written"] - data["bytes_copied"] == 24 and data["tensors"] == real.tensors == 3
    )
    loaded = _flat(torch.load("out.pt", weights_only=True))
    got = {
        k: (str(t.dtype)[6:], tuple(t.shape), t.numel() * t.element_size())
        for k, t in loaded.items()
    }
    [planned] = data["planned_files"]
    assert planned["name"] == "out.pt" and list(got.items()) == list(_planned_rows(planned).items())
    # The tied tensor is written once: the planned bytes are the storages', not the keys'.
    assert planned["nbytes"] == data["planned_bytes"] == 48 + 12 + 24


def test_sanitize_dry_run_refuses_with_the_write_s_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _messy(tmp_path / "in.pt")
    Path("taken.pt").write_bytes(b"x")
    for args, code in (
        (["sanitize", "in.pt", "o.pt", "--strict"], 3),
        (["sanitize", "in.pt", "taken.pt"], 6),
        (["sanitize", "in.pt", "in.pt", "--force"], 6),
        (["sanitize", str(FIXTURES / "torchscript.pt"), "o.pt"], 7),
    ):
        got, err = _dry_run_then_write(args, tmp_path, capsys)
        assert got == code, (args, err)


# --- convert to a folder, reshard ----------------------------------------------------------


def _tied(path: Path) -> None:
    torch.manual_seed(2)
    embed = torch.randn(16, 8)
    sd = {
        "embed.weight": embed,
        "lm_head.weight": embed,
        "norm.weight": torch.ones(8, dtype=torch.bfloat16),
    }
    sd |= {f"layers.{i}.weight": torch.randn(8, 8) for i in range(4)}
    torch.save(sd, path)


def _check_folder_plan(data: dict[str, Any], files: tuple[str, ...]) -> None:
    assert [f["name"] for f in data["planned_files"]] == list(files)
    for planned in data["planned_files"]:
        path = Path(planned["name"])
        if planned["name"].endswith(".index.json"):
            assert planned["nbytes"] == path.stat().st_size
            weight_map = json.loads(path.read_text())["weight_map"]
            assert weight_map == {
                t["key"]: Path(f["name"]).name for f in data["planned_files"] for t in f["tensors"]
            }
        else:
            assert _safetensors_rows(path) == _planned_rows(planned)


def test_convert_to_folder_and_reshard_dry_runs_plan_what_they_write(tmp_path: Path) -> None:
    _tied(tmp_path / "in.pt")
    before = _snapshot(tmp_path)
    data = _dry_json(["convert", "in.pt", "hf/", "--max-shard-size", "600"])
    text = (
        CliRunner()
        .invoke(cli, ["convert", "in.pt", "hf/", "--max-shard-size", "600", "--dry-run"])
        .output
    )
    assert (
        _snapshot(tmp_path) == before
        and "nothing written" in text
        and "model.safetensors.index.json" in text
    )
    assert data["dropped"] == ["lm_head.weight"]  # tied: stored once, as huggingface_hub does

    real = convert_to_folder("in.pt", "hf/", max_shard_size="600")
    assert (
        real.written
        and real.dropped == tuple(data["dropped"])
        and real.bytes_written == data["planned_bytes"]
    )
    _check_folder_plan(data, real.written)

    before = _snapshot(tmp_path)
    data = _dry_json(["reshard", "hf", "hf2", "--max-shard-size", "1000"])
    assert _snapshot(tmp_path) == before
    real = reshard("hf", "hf2", max_shard_size="1000")
    _check_folder_plan(data, real.written)
    assert data["message"].startswith("dry run: would reshard")


def test_folder_dry_runs_refuse_with_the_write_s_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tied(tmp_path / "in.pt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with warnings.catch_warnings():  # ("ComplexHalf support is experimental")
        warnings.simplefilter("ignore")
        torch.save({"w": torch.zeros(2, dtype=torch.complex32)}, tmp_path / "complex.pt")
    for args, code in (
        (["convert", "in.pt", "full/"], 6),
        (["convert", "in.pt", "no/such/"], 6),
        (["convert", "complex.pt", "c/"], 7),
        (["convert", str(FIXTURES / "trainer_adam.pt"), "t/"], 7),
        (["reshard", "in.pt", "r/", "--max-shard-size", "1KB"], 2),
        (["reshard", "full", "r/", "--max-shard-size", "0"], 2),
    ):
        got, err = _dry_run_then_write(args, tmp_path, capsys)
        assert got == code, (args, err)


# --- slim --ema and extract on a pickled Ultralytics-style module --------------------------

ULTRA = """
import torch
from torch import nn


class DetectionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1))
        self.head = nn.Linear(4, 4)
        self.tied = self.head  # one module under two names: state_dict() lists both
        self.names = {0: "cat"}

    def forward(self, x):
        return self.model(x)
"""


def _ultralytics(
    tmp_path: Path, load: Callable[[str, str], Any], **more: Any
) -> dict[str, torch.Tensor]:
    """``{"model": DetectionModel, "ema": DetectionModel, "updates": ...}`` as Ultralytics saves
    it (half precision), the class gone afterwards; returns the EMA's ``state_dict()``."""
    torch.manual_seed(3)
    mod = load("ultra_model", ULTRA)
    model = mod.DetectionModel()
    model.model[1].running_mean.uniform_()
    model.model[1].num_batches_tracked += 4
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 3, 5, 5)).sum().backward()
    optim.step()
    ema = ema.half()
    expected = {k: v.clone() for k, v in ema.state_dict().items()}
    torch.save(
        {
            "epoch": 9,
            "best_fitness": 0.5,
            "model": copy.deepcopy(model).half(),
            "ema": ema,
            "updates": 12,
            "optimizer": optim.state_dict(),
            "train_args": {"imgsz": 640},
            "date": "2026-11-23",
            **more,
        },
        tmp_path / "best.pt",
    )
    sys.modules.pop("ultra_model")
    (tmp_path / "src" / "ultra_model.py").unlink()
    assert importlib.util.find_spec("ultra_model") is None
    return expected


def test_slim_ema_takes_a_pickled_ultralytics_ema_module_as_a_plain_state_dict(
    tmp_path: Path, unimportable: Callable[[str, str], Any]
) -> None:
    expected = _ultralytics(tmp_path, unimportable)
    assert "tied.weight" in expected and "model.1.num_batches_tracked" in expected
    before = _snapshot(tmp_path)
    planned = _dry_json(["slim", "best.pt", "ema.pt", "--ema"])
    assert _snapshot(tmp_path) == before
    result = CliRunner().invoke(cli, ["slim", "best.pt", "ema.pt", "--ema"])
    assert result.exit_code == 0, result.output
    assert "took the EMA copy 'ema'" in result.output
    assert "'ema' is a pickled nn.Module `DetectionModel`" in result.output
    assert "written as a plain state dict" in result.output
    assert (
        planned["notes"][:2]
        == [n.removeprefix("  note: ") for n in result.output.splitlines() if "note:" in n][:2]
    )

    out = torch.load("ema.pt", weights_only=True)  # the oracle: plain torch, nothing to import
    assert list(out) == list(expected)
    for key, value in expected.items():
        assert type(out[key]) is torch.Tensor and not out[key].requires_grad
        assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
    # One module under two names: one storage, as state_dict() gives it.
    assert (
        out["tied.weight"].untyped_storage().data_ptr()
        == out["head.weight"].untyped_storage().data_ptr()
    )

    st = ct.slim("best.pt", "ema.safetensors", ema=True, dtype="fp32")
    assert st.written and "model.0.weight" in st.cast
    loaded = {k: v for k, v in safe_open_all(tmp_path / "ema.safetensors").items()}
    assert all(
        torch.equal(loaded[k], expected[k].float())
        for k in loaded
        if expected[k].is_floating_point()
    )


def safe_open_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_extract_takes_a_pickled_module_and_other_globals_still_refuse(
    tmp_path: Path, unimportable: Callable[[str, str], Any], capsys: pytest.CaptureFixture[str]
) -> None:
    expected = _ultralytics(tmp_path, unimportable)
    result = ct.extract("best.pt", "conv0.pt", prefix="model.0.", strip_prefix=True, ema=True)
    assert result.written and any("'ema' is a pickled nn.Module" in n for n in result.notes)
    out = torch.load("conv0.pt", weights_only=True)
    assert list(out) == ["weight", "bias"]
    assert torch.equal(out["weight"], expected["model.0.weight"])
    # Without --ema extract selects as inspect does: Ultralytics' live "model", recovered too.
    live = ct.extract("best.pt", "live.pt", prefix="head.", select="model")
    assert live.kept == ("head.weight", "head.bias")
    assert not torch.equal(
        torch.load("live.pt", weights_only=True)["head.weight"], expected["head.weight"]
    )

    # The dry run plans the same: nothing written, the same keys.
    before = _snapshot(tmp_path)
    planned = ct.extract(
        "best.pt", "x.pt", prefix="model.0.", strip_prefix=True, ema=True, dry_run=True
    )
    assert _snapshot(tmp_path) == before and planned.kept == result.kept


def test_ema_refusals_match_between_dry_run_and_write(
    tmp_path: Path, unimportable: Callable[[str, str], Any], capsys: pytest.CaptureFixture[str]
) -> None:
    _ultralytics(tmp_path, unimportable, odd=Unlisted())
    for args in (
        ["slim", "best.pt", "e.pt", "--ema"],
        ["extract", "best.pt", "e.pt", "--prefix", "model.", "--ema"],
    ):
        code, dry_err = _dry_run_then_write(args, tmp_path, capsys)
        assert code == 3 and "Unlisted" in dry_err
        assert main([*args, "--allow-global", f"{__name__}.Unlisted"]) == 0
        os.unlink("e.pt")


def test_a_renaming_dry_run_to_safetensors_drops_what_the_write_drops(tmp_path: Path) -> None:
    # The dry run plans from the same renamed state dict the write uses: tied names and
    # non-tensor entries dropped alike, after the prefixes are stripped.
    embed = torch.randn(16, 8)
    sd = {"module.embed.weight": embed, "module.lm_head.weight": embed, "module.step": 3}
    torch.save(sd | {"module.fc.weight": torch.randn(4, 8)}, tmp_path / "ddp.pt")
    kw = {"drop_extras": True}
    planned = ct.strip_module(tmp_path / "ddp.pt", tmp_path / "out.safetensors", dry_run=True, **kw)
    assert not planned.written and not (tmp_path / "out.safetensors").exists()
    real = ct.strip_module(tmp_path / "ddp.pt", tmp_path / "out.safetensors", **kw)
    assert real.written and real.dropped == planned.dropped
    assert "lm_head.weight" in " ".join(real.dropped) and "step" in " ".join(real.dropped)
    assert set(planned.examples) >= set(real.examples)
    with safe_open(str(tmp_path / "out.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "fc.weight"]
