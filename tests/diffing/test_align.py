"""diff(align=True): what the alignment fixed is said once, never suggested again; what it left
is suggested with commands that apply to the files as stored."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch
from torch import nn

from ckpt_tools.diffing.engine import diff
from tests.helpers import run_ckpt


def layers(prefix: str = "layers.") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for i in range(3):
        sd[f"{prefix}{i}.weight"] = torch.randn(4, 3)
        sd[f"{prefix}{i}.bias"] = torch.randn(4)
    return sd


def wrapped(sd: dict[str, torch.Tensor], prefix: str = "module.") -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in sd.items()}


def run(command: str) -> None:
    args = shlex.split(command)
    assert args[0] == "ckpt"
    run_ckpt(*args[1:], "-q")


def test_an_alignment_that_fixes_everything_suggests_nothing(tmp_path: Path) -> None:
    a, b = tmp_path / "ddp.pt", tmp_path / "plain.pt"
    torch.save(wrapped(layers()), a)
    torch.save(layers(), b)
    report = diff(a, b, align=True)
    assert report.identical and report.suggestions == ()
    text = report.text()
    assert "suggestions" not in text and "adding 'module.'" not in text
    assert text.endswith("identical: same keys, every tensor bit-equal")
    # Said once, in the aligned line, with the command that makes it permanent.
    assert report.aligned == ("stripping 'module.'",)
    assert report.aligned_command.startswith("ckpt strip-module ")
    assert f"to make it permanent: {report.aligned_command}" in text
    assert json.loads(json.dumps(report.to_json()))["suggestions"] == []
    run(report.aligned_command)
    assert diff(tmp_path / "ddp.renamed.pt", b).identical  # without --align now


def test_an_aligned_state_dict_or_module_gets_no_suggestion_either() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    sd = wrapped(model.state_dict(), "_orig_mod.")
    report = diff(sd, model, align=True)
    assert report.identical and report.suggestions == ()
    assert report.aligned_command == "ckpt_tools.strip_prefix(sd_a, prefix='_orig_mod.')"
    unaligned = diff(sd, model)  # without --align the same rewrite is the suggestion
    assert unaligned.suggestions[0].description == "stripping '_orig_mod.'"
    assert diff(model, model.state_dict(), align=True).aligned_command == ""


def test_what_the_alignment_left_is_suggested_and_its_command_fixes_the_stored_file(
    tmp_path: Path,
) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    proj = torch.ones(2, 2)
    torch.save(wrapped({**layers(), "encoder.proj.weight": proj}), a)  # module.layers.0.weight
    torch.save({**layers(), "decoder.proj.weight": proj}, b)
    report = diff(a, b, align=True)
    assert report.aligned == ("stripping 'module.'",)
    assert report.unexpected == ("encoder.proj.weight",)
    assert report.missing == ("decoder.proj.weight",)
    best = report.suggestions[0]
    assert best.description == "renaming 'encoder.' to 'decoder.'"
    assert all("module." not in s.description for s in report.suggestions)
    assert (best.resolved, best.of) == (1, 1)
    assert "suggestions for what the alignment left:" in report.text()
    # The command runs on A as stored: it strips 'module.' too.
    run(best.command)
    assert diff(tmp_path / "a.renamed.pt", b).identical
    # The inverse makes B match A as stored.
    assert best.inverse_description == "renaming 'decoder.' to 'encoder.', then adding 'module.'"
    run(best.inverse_command)
    assert diff(a, tmp_path / "b.renamed.pt").identical


def test_without_align_the_suggestions_are_unchanged(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(wrapped(layers()), a)
    torch.save(layers(), b)
    report = diff(a, b)
    assert report.aligned == () and report.aligned_command == ""
    best = report.suggestions[0]
    assert best.description == "stripping 'module.'"
    assert "\nsuggestions:\n" in report.text()
    run(best.command)
    assert diff(tmp_path / "a.renamed.pt", b).identical
