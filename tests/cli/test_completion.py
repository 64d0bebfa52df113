"""Shell completion through click's protocol (``_CKPT_COMPLETE``), over the lazy group.

What docs/shell-completion.md sets up: the shell runs the installed ``ckpt`` with
``_CKPT_COMPLETE=<shell>_complete`` and the words typed so far, and reads the candidates.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_ckpt, torch_free_env


def complete(words: str, shell: str = "bash", **env: str) -> list[str]:
    """The candidates the installed ``ckpt`` offers for the last word of ``words``."""
    cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
    if shell == "fish":  # fish passes the word being completed, not its index
        cword = "" if words.endswith(" ") else words.split()[-1]
    variables = {
        "_CKPT_COMPLETE": f"{shell}_complete",
        "COMP_WORDS": words,
        "COMP_CWORD": cword,
        **env,
    }
    return run_ckpt(how="script", env=variables).stdout.splitlines()


def test_a_command_name_completes() -> None:
    assert complete("ckpt str") == ["plain,strip-module"]
    assert complete("ckpt harness p") == ["plain,parity"]


def test_every_command_is_offered(tmp_path: Path) -> None:
    offered = complete("ckpt ", **torch_free_env(tmp_path))  # listing them imports no torch
    assert "plain,inspect" in offered and "plain,harness" in offered
    assert len(offered) == 17


def test_options_and_their_values_complete() -> None:
    options = complete("ckpt strip-module --")
    assert {"plain,--quiet", "plain,--prefix", "plain,--dry-run", "plain,--help"} <= set(options)
    assert complete("ckpt convert model.pt out --format ") == ["plain,torch", "plain,safetensors"]
    assert complete("ckpt diff a.pt b.pt --fail") == ["plain,--fail-on"]


def test_paths_are_left_to_the_shell() -> None:
    # click answers "file": the shell's own file-name completion takes over.
    assert complete("ckpt inspect ") == ["file,"]


@pytest.mark.parametrize(
    ("shell", "expected"),
    [
        ("zsh", ["plain", "strip-module", "Strip wrapper prefixes (DataParallel/DDP..."]),
        ("fish", ["plain,strip-module\tStrip wrapper prefixes (DataParallel/DDP..."]),
    ],
)
def test_zsh_and_fish_get_the_summary_too(shell: str, expected: list[str]) -> None:
    assert complete("ckpt strip-m", shell) == expected


@pytest.mark.parametrize(
    ("shell", "marker"),
    [
        ("bash", "complete -o nosort -F _ckpt_completion ckpt"),
        ("zsh", "#compdef ckpt"),
        ("fish", "complete --no-files --command ckpt"),
    ],
)
def test_the_setup_script_of_each_shell(shell: str, marker: str) -> None:
    script = run_ckpt(how="script", env={"_CKPT_COMPLETE": f"{shell}_source"}).stdout
    assert marker in script and "_CKPT_COMPLETE" in script
