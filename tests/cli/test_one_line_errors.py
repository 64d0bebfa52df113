"""An error is one stderr line, whatever the names it quotes hold.

A key read from a checkpoint may hold a line break: quoted in a message, it shows escaped
(``a\\nb``), so no file can print a line of its own under ``ckpt``'s name. The library's
messages quote such names escaped, and the command line's boundary escapes whatever reaches
it as the last guard.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.cli.boundary import guarded
from ckpt_tools.errors import ConversionError, NonTensorEntriesError, UsageError
from tests.helpers import run_ckpt

FAKE = "ckpt: ok wrote everything"


def _one_line(stderr: str) -> str:
    assert stderr.startswith("ckpt: error: ") and stderr.count("\n") == 1, stderr
    return stderr


def test_convert_quotes_a_non_tensor_entry_with_a_line_break_on_one_line(tmp_path: Path) -> None:
    src = tmp_path / "extras.pt"
    torch.save({"w": torch.ones(1), f"epoch\n{FAKE}": 3}, src)
    run = run_ckpt("convert", src, tmp_path / "o.safetensors", code=7)
    assert f"epoch\\n{FAKE}; " in _one_line(run.stderr)
    assert not (tmp_path / "o.safetensors").exists()


def test_the_library_message_names_the_entry_escaped(tmp_path: Path) -> None:
    src = tmp_path / "extras.pt"
    torch.save({"w": torch.ones(1), f"epoch\n{FAKE}": 3}, src)
    with pytest.raises(NonTensorEntriesError) as raised:
        ct.convert(src, tmp_path / "o.safetensors")
    assert "\n" not in str(raised.value) and f"epoch\\n{FAKE}" in str(raised.value)


def test_rename_matching_nothing_lists_key_starts_on_one_line(tmp_path: Path) -> None:
    src = tmp_path / "keys.pt"
    torch.save({"a\nb.w": torch.ones(1), "e\x1b[31m.w": torch.ones(1)}, src)
    run = run_ckpt("rename", src, tmp_path / "o.pt", "--regex", "zzz=y", code=2)
    assert "(the keys start with a\\nb., e\\x1b[31m.)" in _one_line(run.stderr)
    with pytest.raises(UsageError) as raised:
        ct.rename(src, tmp_path / "o.pt", rules=[ct.regex_rule("zzz", "y")])
    assert "\n" not in str(raised.value)


def test_the_boundary_writes_any_message_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    text = "two\nlines\r\nand\x85more\u2028breaks"

    def fails() -> None:
        raise ConversionError(f"found {text}")

    assert guarded(fails, "ckpt") == ConversionError.exit_code
    err = _one_line(capsys.readouterr().err)
    assert err.rstrip("\n") == "ckpt: error: found " + repr(text)[1:-1]
