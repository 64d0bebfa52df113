"""The example runner fails a broken example: each way an example can break is shown failing.

These run synthetic pages through the same parser and runner as the real ones, in the same
folder of example files, so a runner that passed everything would fail here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import Block, misfiled, parse
from tests.docs.runner import ExampleFailed, commands, run_python, run_shell, split_comment
from tests.docs.workspace import fresh_copy


@pytest.fixture
def folder(docs_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = fresh_copy(docs_template, tmp_path / "work")
    monkeypatch.chdir(work)
    return work


def _block(text: str, lang: str = "bash") -> Block:
    (block,) = parse(f"# page\n\n```{lang}\n{text}\n```\n", "synthetic.md")
    return block


def test_a_command_that_works_passes(folder: Path) -> None:
    run_shell(
        _block("ckpt inspect model.pt --limit 0\nckpt inspect lfs.pt   # exit 4: pointer"), folder
    )


@pytest.mark.parametrize(
    ("text", "lang", "complaint"),
    [
        ("ckpt inspect no-such-file.pt", "bash", "exited 2, expected 0"),
        ("ckpt inspect model.pt   # exit 4: it is corrupt", "bash", "exited 0, expected 4"),
        ("ckpt inspect model.pt --no-such-flag", "bash", "exited 2"),
        ("$ ckpt inspect model.pt --limit 0\nformat:      torch-legacy", "console", "not printed"),
        ("$ ckpt scan evil.pt\nclean  evil.pt (torch-zip)", "console", "exited 1"),
        ("make no-such-target", "bash", "no rule"),
        ("pip install 'ckpt_tools[gpu]'", "bash", "no extra 'gpu'"),
        ("ckpt-tool inspect model.pt", "bash", "exited 127"),
    ],
)
def test_a_broken_shell_example_fails(text: str, lang: str, complaint: str, folder: Path) -> None:
    with pytest.raises(ExampleFailed, match=complaint):
        run_shell(_block(text, lang), folder)


def test_a_broken_python_example_fails(folder: Path) -> None:
    run_python(
        _block("import ckpt_tools as ct\nassert ct.inspect('model.pt').tensors", "python"), folder
    )
    with pytest.raises(AttributeError):
        run_python(
            _block("import ckpt_tools as ct\nct.no_such_function('model.pt')", "python"), folder
        )
    with pytest.raises(AssertionError):
        run_python(
            _block("import ckpt_tools as ct\nassert len(ct.inspect('model.pt')) == 3", "python"),
            folder,
        )


def test_commands_comments_and_output_are_parsed() -> None:
    block = _block(
        "$ ckpt diff a.pt b.pt \\\n  --fail-on value  # exit 1: differ\nline one\n\nline two",
        "console",
    )
    (command,) = commands(block)
    assert (command.text, command.code, command.output) == (
        "ckpt diff a.pt b.pt --fail-on value",
        1,
        ["line one", "line two"],
    )
    assert split_comment("ckpt rename a b --regex 'x#y=z'  # why") == (
        "ckpt rename a b --regex 'x#y=z'  ",
        "# why",
    )
    assert commands(_block("ckpt scan x  # exits 1 when dangerous"))[0].code == 0


def test_markers_are_read_and_unknown_ones_refused() -> None:
    page = (
        "text\n\n<!-- needs: gpu -->\n\n```bash\nckpt devices\n```\n\n```bash\nckpt devices\n```\n"
    )
    first, second = parse(page, "p.md")
    assert first.markers == {"needs": "gpu"} and second.markers == {}
    with pytest.raises(ValueError, match="needs 'laptop'"):
        parse("<!-- needs: laptop -->\n```bash\nckpt devices\n```\n", "p.md")
    with pytest.raises(ValueError, match="unknown marker 'skip'"):
        parse("<!-- skip: yes -->\n```bash\nckpt devices\n```\n", "p.md")


def test_a_command_in_a_block_that_is_not_run_is_found() -> None:
    assert misfiled(_block("ckpt inspect model.pt", "text")) == ["ckpt inspect model.pt"]
    assert misfiled(_block("$ ckpt inspect model.pt", "")) == ["$ ckpt inspect model.pt"]
    assert misfiled(_block("ckpt_tools/\n  cli/   the command", "")) == []
