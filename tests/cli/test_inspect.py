"""``ckpt inspect``: its table, ``--group``, ``--json``, ``--select``, and the console script."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools.cli.main import main
from ckpt_tools.errors import EXIT_USAGE
from tests.helpers import at_path, ckpt_env, describe, fixture_path, run_ckpt, tensors_of

TENSOR_FIELDS = {"name", "dtype", "shape", "nbytes", "device", "storage", "offset"}
WRAPPER_FIELDS = {"prefix", "kind", "count", "of", "inner"}
TOP_FIELDS = {
    "path",
    "format",
    "selected",
    "tensors",
    "wrappers",
    "unsafe_globals",
    "entries",
    "total_params",
    "total_bytes",
}


def invoke(*args: str) -> str:
    return run_ckpt("inspect", *args).stdout


def torch_state_dict(name: str, select: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    return tensors_of(at_path(torch.load(fixture_path(name), weights_only=True), select))


def shape_text(t: torch.Tensor) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def table_rows(output: str) -> dict[str, list[str]]:
    """The tensor table's rows by name (columns split on runs of 2+ spaces)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("name "))
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 2 :] if line.strip()]
    return {row[0]: row for row in rows}


def test_table_lists_every_tensor() -> None:
    output = invoke(str(fixture_path("trainer_sgd.pt")))
    expected = torch_state_dict("trainer_sgd.pt", ("model",))
    assert "format:      torch-zip" in output
    assert f"tensors:     {len(expected)}" in output
    assert "state dict:  model (" in output
    rows = table_rows(output)
    assert list(rows) == list(expected)
    for name, t in expected.items():
        assert rows[name][1:4] == [str(t.dtype).removeprefix("torch."), shape_text(t), "cpu"]


def test_table_shows_sharing_and_offsets() -> None:
    output = invoke(str(fixture_path("tied_views.pt")))
    expected = torch.load(fixture_path("tied_views.pt"), weights_only=True)
    rows = table_rows(output)
    assert rows["table_tail"][5] == str(expected["table_tail"].storage_offset())
    assert "lm_head.weight" in rows["embed.weight"][-1]


def test_group_folds_repeated_layers() -> None:
    expected = torch_state_dict("plain.pt")
    layer_keys = [k for k in expected if re.fullmatch(r"layers\.\d+\.weight", k)]
    indices = sorted(int(k.split(".")[1]) for k in layer_keys)
    assert len(layer_keys) > 1
    output = invoke(str(fixture_path("plain.pt")), "--group")
    folded = f"layers.{{{indices[0]}..{indices[-1]}}}.weight ×{len(layer_keys)}"
    assert folded in output
    assert "layers.0.weight " not in output
    assert "conv.weight " in output  # a tensor alone stays as it is


def test_limit_hides_rows() -> None:
    output = invoke(str(fixture_path("plain.pt")), "--limit", "3")
    hidden = len(torch_state_dict("plain.pt")) - 3
    assert len(table_rows(output.split("\n...")[0])) == 3
    assert f"... {hidden} more rows" in output


def test_json_schema() -> None:
    path = fixture_path("dataparallel.pt")
    report = json.loads(invoke(str(path), "--json"))
    expected = torch_state_dict("dataparallel.pt")
    assert set(report) >= TOP_FIELDS
    assert report["path"] == str(path)
    assert report["format"] == "torch-zip"
    assert report["selected"] == []
    assert report["unsafe_globals"] == []
    assert report["entries"] == {}
    assert report["total_params"] == sum(t.numel() for t in expected.values())
    assert report["total_bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert [t["name"] for t in report["tensors"]] == list(expected)
    for row in report["tensors"]:
        assert set(row) >= TENSOR_FIELDS
        want = describe(expected[row["name"]])
        got = {k: row[k] for k in ("dtype", "nbytes", "device", "offset")}
        assert got == {k: want[k] for k in got}
        assert row["shape"] == list(want["shape"])
        assert isinstance(row["storage"], str)
    assert len(report["wrappers"]) == 1
    wrapper = report["wrappers"][0]
    assert set(wrapper) == WRAPPER_FIELDS
    assert (wrapper["prefix"], wrapper["count"], wrapper["of"]) == (
        "module.",
        sum(k.startswith("module.") for k in expected),
        len(expected),
    )


def test_json_entries_beside_the_state_dict() -> None:
    report = json.loads(invoke(str(fixture_path("state_dict.pt")), "--json"))
    truth = torch.load(fixture_path("state_dict.pt"), weights_only=True)
    assert report["selected"] == ["state_dict"]
    assert set(report["entries"]) == set(truth) - {"state_dict"}
    assert report["entries"]["epoch"] == f"int {truth['epoch']}"


@pytest.mark.parametrize(
    ("name", "select"),
    [("model_ema.pt", "model_ema"), ("trainer_adam.pt", "optimizer.state.0")],
)
def test_select_overrides_the_choice(name: str, select: str) -> None:
    report = json.loads(invoke(str(fixture_path(name)), "--select", select, "--json"))
    expected = torch_state_dict(name, tuple(select.split(".")))
    assert report["selected"] == select.split(".")
    assert [t["name"] for t in report["tensors"]] == list(expected)
    assert [t["shape"] for t in report["tensors"]] == [list(t.shape) for t in expected.values()]


def test_bad_select_names_the_available_keys(capsys: pytest.CaptureFixture[str]) -> None:
    path = fixture_path("model_ema.pt")
    truth = torch.load(path, weights_only=True)
    assert main(["inspect", str(path), "--select", "nope"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'nope'" in err
    assert all(str(key) in err for key in truth)


def test_installed_console_script() -> None:
    path = fixture_path("lightning.ckpt")
    run = run_ckpt("inspect", path, "--json", how="script")
    assert run.returncode == 0, run.stderr
    report: dict[str, Any] = json.loads(run.stdout)
    assert report == ckpt_tools.inspect(path).to_json()
    assert [w["prefix"] for w in report["wrappers"]] == ["model."]


# `ckpt ARGV` in a fresh process, then the names of every module it loaded. What the
# interpreter had loaded before (site, the environment's .pth files) is not the command's.
_LOADED_AFTER = """
import sys
before = set(sys.modules)
from ckpt_tools.cli.main import main
code = main(sys.argv[1:])
print(sorted(set(sys.modules) - before))
sys.exit(code)
"""

# What describing a file never needs: torch, numpy, the writers, and every reader but its own.
_NEVER = ("torch", "numpy", "ckpt_tools.io.writers", "ckpt_tools.io.copy", "ckpt_tools.io.atomic")
_OTHER_READERS = {
    "model.safetensors": (
        "tarfile",
        "pickletools",
        "ckpt_tools.formats.dcp",
        "ckpt_tools.formats.zip",
        "ckpt_tools.formats.pickle",
        "ckpt_tools.formats.legacy",
        "ckpt_tools.formats.hf",
    ),
    "model.pt": (
        "tarfile",
        "ckpt_tools.formats.dcp",
        "ckpt_tools.formats.safetensors",
        "ckpt_tools.formats.legacy",
        "ckpt_tools.formats.hf",
    ),
}
# The reader a file's format needs is loaded: the test sees the imports it means to.
_OWN_READER = {
    "model.safetensors": "ckpt_tools.formats.safetensors",
    "model.pt": "ckpt_tools.formats.zip.torchzip",
}


def _loaded(name: str, *options: str) -> set[str]:
    run = subprocess.run(
        [sys.executable, "-c", _LOADED_AFTER, "inspect", str(fixture_path(name)), *options],
        capture_output=True,
        text=True,
        env=ckpt_env(),
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    return set(ast.literal_eval(run.stdout.splitlines()[-1]))


def _among(loaded: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(
        m for m in loaded if m in packages or m.startswith(tuple(f"{p}." for p in packages))
    )


@pytest.mark.parametrize("name", sorted(_OTHER_READERS))
def test_inspect_imports_its_format_s_reader_only(name: str) -> None:
    # Each module a command imports costs every run of it: a reader is imported where a
    # file of its format was detected; tabulate only for a table whose cells the library's
    # text_table does not lay out as tabulate does (line breaks, escapes, wide characters).
    table = _loaded(name)
    as_json = _loaded(name, "--json")
    for loaded in (table, as_json):
        assert _OWN_READER[name] in loaded
        assert _among(loaded, _NEVER + _OTHER_READERS[name]) == []
    assert _among(table, ("tabulate",)) == []
    assert _among(as_json, ("tabulate", "zipfile")) == []


@pytest.mark.parametrize("table_option", [["--group"], ["--limit", "2"]])
def test_table_options_with_json_are_refused_not_ignored(table_option: list[str]) -> None:
    path = fixture_path("dataparallel.pt")
    result = run_ckpt("inspect", path, "--json", *table_option, code=2)
    assert result.stdout == "" and f"{table_option[0]} shapes the table" in result.stderr
