"""The torch file a refusal suggests never names the input or another existing file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools.cli.main import main
from ckpt_tools.errors import ConversionError, UsageError
from ckpt_tools.ops.rewrite.plan import free_name, output_format_for, torch_instead
from tests import helpers as h


def test_free_name_swaps_the_suffix_when_nothing_is_there(tmp_path: Path) -> None:
    assert free_name(tmp_path / "mk.safetensors", ".pt") == str(tmp_path / "mk.pt")


def test_free_name_passes_over_existing_files_and_dangling_links(tmp_path: Path) -> None:
    (tmp_path / "mk.pt").write_bytes(b"")
    assert free_name(tmp_path / "mk.safetensors", ".pt") == str(tmp_path / "mk.converted.pt")
    (tmp_path / "mk.converted.pt").symlink_to(tmp_path / "gone")
    assert free_name(tmp_path / "mk.safetensors", ".pt") == str(tmp_path / "mk.converted-2.pt")


def test_torch_instead_does_not_suggest_the_input(tmp_path: Path) -> None:
    (tmp_path / "mk.pt").write_bytes(b"")
    said = torch_instead(tmp_path / "mk.safetensors").render(for_cli=True)
    assert said == f"keep the torch format: name the output {str(tmp_path / 'mk.converted.pt')!r}"


def test_a_contradicting_format_does_not_suggest_the_input(tmp_path: Path) -> None:
    (tmp_path / "mk.pt").write_bytes(b"")
    with pytest.raises(UsageError) as caught:
        output_format_for(tmp_path / "mk.safetensors", "torch", "torch-zip")
    assert [r.text for r in caught.value.remedies] == [
        f"name it {str(tmp_path / 'mk.converted.pt')!r}"
    ]


def test_convert_refusal_suggests_a_name_that_is_then_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = h.save({"w": torch.arange(3.0)._neg_view()}, tmp_path / "mk.pt")
    code = main(["convert", str(src), str(tmp_path / "mk.safetensors")])
    err = capsys.readouterr().err
    assert code == ConversionError.exit_code, err
    suggested = tmp_path / "mk.converted.pt"
    assert f"name the output {str(suggested)!r}" in err and f"{str(src)!r}," not in err
    assert main(["convert", str(src), str(suggested)]) == 0
    loaded = torch.load(suggested, weights_only=True)["w"]
    assert loaded.is_neg() and torch.equal(loaded, -torch.arange(3.0))
