"""Results read well: ``str`` is the command's text, ``repr`` is short, lookups work by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ckpt_tools
from ckpt_tools.cli.main import cli
from ckpt_tools.cli.render import table as cli_table
from ckpt_tools.diffing.engine import diff
from ckpt_tools.errors import CheckpointError, SelectError
from ckpt_tools.loading import module_spec
from ckpt_tools.loading.into_module import load_into
from ckpt_tools.loading.results import ShapeMismatch
from ckpt_tools.loading.state_dict import load_with_info
from ckpt_tools.ops.inspect.inspection import inspect
from ckpt_tools.ops.rewrite.rewriting import strip_module
from ckpt_tools.structure.grouping import fold_keys, fold_names
from ckpt_tools.structure.text import text_table

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DP = FIXTURES / "dataparallel.pt"


def _layers(n: int, prefix: str = "") -> dict[str, torch.Tensor]:
    return {f"{prefix}layers.{i}.weight": torch.full((2, 2), float(i)) for i in range(n)}


def test_inspect_text_is_what_the_command_prints() -> None:
    info = inspect(DP)
    printed = CliRunner().invoke(cli, ["inspect", str(DP)], catch_exceptions=False).output
    assert printed == info.text(table=cli_table, for_cli=True) + "\n"
    # The library's own table lays rows out as tabulate does: no drift between the two.
    assert info.text(for_cli=True) == info.text(table=cli_table, for_cli=True)
    assert str(info) == info.text()
    assert str(info).startswith(f"file:        {DP}\nformat:      torch-zip")
    assert "CheckpointInfo(" not in str(info) and "--" not in str(info).split("\n\n")[0]


def test_reprs_are_short() -> None:
    info = inspect(DP)
    assert repr(info).startswith("CheckpointInfo(path=") and len(repr(info)) < 200
    _, load = load_with_info(DP)
    assert repr(load).startswith("LoadInfo(") and len(repr(load)) < 200
    report = diff(DP, DP)
    assert repr(report).startswith("DiffReport(") and len(repr(report)) < 200


def test_text_table_matches_tabulate_on_uneven_cells() -> None:
    rows = [["a", "float32", "[1, 2]"], ["layers.{0..31}.weight ×32", "bf16", ""]]
    headers = ("name", "dtype", "shape")
    assert text_table(rows, headers) == cli_table(rows, headers)


def test_diff_text_is_what_the_command_prints(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(_layers(20), a)
    torch.save({**_layers(3), "head.bias": torch.zeros(2)}, b)
    report = diff(a, b)
    printed = CliRunner().invoke(cli, ["diff", str(a), str(b)], catch_exceptions=False).output
    assert printed.startswith(report.text(table=cli_table, for_cli=True))
    text = str(report)
    assert "unexpected (in A, not in B): 17" in text
    assert "  layers.{3..19}.weight ×17" in text  # folded by structure.grouping
    assert "DiffReport(" not in text


def test_load_and_rewrite_results_read_as_text(tmp_path: Path) -> None:
    _, load = load_with_info(DP, map_location="cpu")
    assert str(load).startswith(f"loaded {load.tensors} tensors from {DP}")
    result = strip_module(DP, tmp_path / "out.pt")
    assert str(result) == result.text() and "RewriteResult(" not in str(result)
    assert repr(result).startswith("RewriteResult(") and len(repr(result)) < 300


def test_tensor_lookup_by_name() -> None:
    info = inspect(DP)
    first = next(iter(info))
    assert info.tensor(first.name) is first
    assert first.name in info and "nope" not in info and 3 not in info
    assert len(info) == len(info.tensors) and list(info) == list(info.tensors)
    bare = first.name.removeprefix("module.")
    with pytest.raises(SelectError, match=rf"no tensor '{bare}'.*close: {first.name}") as err:
        info.tensor(bare)
    assert isinstance(err.value, KeyError) and isinstance(err.value, CheckpointError)
    assert f"pass name='{first.name}'" in str(err.value)


def test_package_dir_lists_lazy_names() -> None:
    names = dir(ckpt_tools)
    for name in ("inspect", "load_into", "diff", "DiffReport", "CheckpointInfo", "__version__"):
        assert name in names


def test_module_from_spec_replaces_build_model() -> None:
    assert not hasattr(module_spec, "build_model")
    made = module_spec.module_from_spec("torch.nn:Linear", {"in_features": 2, "out_features": 3})
    assert isinstance(made, nn.Linear)


def test_load_report_names_say_what_they_hold(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, path)
    report = load_into(nn.Linear(4, 3), path, strict=False)
    assert report.model_class == "Linear"
    mismatch = report.shape_mismatches[0]
    assert (mismatch.checkpoint_shape, mismatch.model_shape) == ((2, 4), (3, 4))
    # JSON keys stay as they were.
    assert report.to_json()["model"] == "Linear"
    assert ShapeMismatch("w", (1,), (2,)).to_json() == {
        "key": "w",
        "checkpoint": [1],
        "model": [2],
    }
    assert "LoadReport(" not in str(report)


def test_one_folding_helper_for_key_lists() -> None:
    keys = [f"layers.{i}.attn.weight" for i in range(32)] + ["head.bias", "x", "y"]
    assert (
        fold_keys(keys, limit=2) == "layers.{0..31}.attn.weight ×32, head.bias, ... (2 more groups)"
    )
    assert fold_names(keys, group=False, limit=3) == (keys[:3], 32)


def test_folding_indices_far_apart_takes_no_memory_for_the_gap() -> None:
    keys = ["h.0.w", f"h.{10**15}.w", "h.1.w"]
    assert fold_names(keys) == ([f"h.{{0,1,{10**15}}}.w ×3"], 0)
    assert fold_keys(["h.7.w", "h.5.w", "h.6.w"]) == "h.{5..7}.w ×3"


def test_load_into_mismatch_message_folds_keys(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save(_layers(12, "enc."), path)
    with pytest.raises(CheckpointError, match=r"enc\.layers\.\{0\.\.11\}\.weight ×12"):
        load_into(nn.Linear(2, 2), path)


def test_a_name_with_a_line_break_cannot_start_a_line_of_a_load_report(tmp_path: Path) -> None:
    sd = nn.Linear(2, 2).state_dict()
    sd["evil\nloaded 99 keys from x"] = torch.ones(1)
    path = tmp_path / "odd\nname.pt"
    torch.save(sd, path)
    report = load_into(nn.Linear(2, 2), path, strict=False)
    info = load_with_info(path)[1]
    for text in (str(report), str(info)):
        assert "odd\\nname.pt" in text
        assert not any(line.startswith(("loaded 99", "name.pt")) for line in text.splitlines())
    assert "evil\\nloaded 99 keys from x" in str(report)
    assert report.unexpected == ("evil\nloaded 99 keys from x",)  # the data keeps the name


def test_names_in_an_adapter_summary_and_a_tensor_line_are_escaped() -> None:
    from ckpt_tools.ops.merge.info import AdapterInfo

    adapter = AdapterInfo(
        peft_type="LORA",
        base_model="base\x1b[2J",
        r=2,
        alpha=4.0,
        rslora=False,
        dora=False,
        bias="all\x1b[2J",
        lora_bias=False,
        target_modules=["q_proj\nrank:        forged"],
        modules=("q_proj",),
        modules_to_save=("head\rx",),
        patterns={},
        parameters=0,
    )
    lines = adapter.lines()
    assert all(line.isprintable() for line in lines) and len(lines) == 5
    assert "q_proj\\nrank:        forged" in lines[2] and "\\x1b[2J" in lines[0]
    assert lines[3].startswith("biases:      all\\x1b[2J")
    tensor = inspect(DP).tensors[0]
    odd = dataclasses.replace(tensor, name="w\n\x1b")
    assert str(odd).startswith("w\\n\\x1b ") and str(odd).isprintable()


def test_scan_results_print_as_the_command_prints_them() -> None:
    report = ckpt_tools.scan(FIXTURES / "evil.pt")
    printed = CliRunner().invoke(cli, ["scan", str(FIXTURES / "evil.pt")]).output
    assert printed == str(report) + "\n" and str(report) == report.text()
    file = report.files[0]
    assert str(file) == file.text() and str(file) in printed
    assert str(file.findings[0]) in str(file) and str(file.findings[0]).startswith("dangerous: ")
