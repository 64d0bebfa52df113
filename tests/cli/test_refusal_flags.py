"""A refusal names only options of the command that met it.

Errors carry their fixes as remedies (a Python argument and a command-line flag); the CLI
prints the flag. Each case here runs a command into a refusal that a library function shared
by several commands raises, and checks that every ``pass --FLAG`` the message names is an
option of that command (and, for Python callers, that every ``pass NAME=`` is a keyword of
the function they called).
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import click
import pytest
import torch

import ckpt_tools
from ckpt_tools.cli.main import cli
from ckpt_tools.errors import CorruptCheckpointError, SameFileError, SelectError, UsageError
from tests import helpers as h
from tests.helpers.lora import write_tiny_adapter

W = torch.arange(6, dtype=torch.float32).reshape(2, 3)


def _flags(command: str) -> set[str]:
    found = cli.get_command(click.Context(cli), command)
    assert found is not None
    return {o for p in found.params if isinstance(p, click.Option) for o in p.opts}


def _named(stderr: str) -> set[str]:
    """The flags a refusal tells the user to pass."""
    return set(re.findall(r"pass (--[a-z-]+)", stderr))


def _plain(tmp: Path, name: str = "in.pt") -> Path:
    path = tmp / name
    torch.save({"module.a.weight": W}, path)
    return path


#: command -> its command line up to OUT, whose input is the file it returns last.
SAME_FILE: dict[str, Callable[[Path], list[object]]] = {
    "strip-module": lambda t: ["strip-module", _plain(t)],
    "add-module": lambda t: ["add-module", _plain(t)],
    "rename": lambda t: ["rename", "--sub", "module.=m.", _plain(t)],
    "convert": lambda t: ["convert", _plain(t)],
    "retag": lambda t: ["retag", "--map", "cpu=cpu", _plain(t)],
    "slim": lambda t: ["slim", _plain(t)],
    "extract": lambda t: ["extract", "--prefix", "module.", _plain(t)],
    "average": lambda t: ["average", _plain(t), _plain(t, "b.pt")],
    "merge-lora": lambda t: ["merge-lora", _plain(t), write_tiny_adapter(t / "lora"), t / "in.pt"],
    "sanitize": lambda t: ["sanitize", _plain(t)],
}


@pytest.mark.parametrize("command", sorted(SAME_FILE))
def test_an_output_that_is_the_input_names_in_place_only_where_it_is_an_option(
    command: str, tmp_path: Path
) -> None:
    args = SAME_FILE[command](tmp_path)
    if command == "merge-lora":
        args = args[:-1]
    before = (tmp_path / "in.pt").read_bytes()

    _, _, stderr = h.run_ckpt(*args, tmp_path / "in.pt", code=6)
    assert "is the input file" in stderr and "choose another output path" in stderr, stderr
    named = _named(stderr)
    assert named <= _flags(command), (named, stderr)
    assert ("--in-place" in named) == ("--in-place" in _flags(command)), stderr
    assert (tmp_path / "in.pt").read_bytes() == before


def test_python_callers_are_offered_in_place_only_where_it_is_a_keyword(tmp_path: Path) -> None:
    src = _plain(tmp_path)
    for name, call in (
        ("slim", lambda: ckpt_tools.slim(src, src)),
        ("sanitize", lambda: ckpt_tools.sanitize(src, src)),
        ("strip_module", lambda: ckpt_tools.strip_module(src, src)),
    ):
        with pytest.raises(SameFileError) as info:
            call()
        keywords = set(inspect.signature(getattr(ckpt_tools, name)).parameters)
        offered = {r.argument for r in info.value.remedies if r.argument is not None}
        assert offered <= keywords and ("in_place" in offered) == ("in_place" in keywords), name


def _save_folder(tmp: Path) -> Path:
    """A DeepSpeed save folder whose ``latest`` names a tag that is not there.

    The tags are refused before a rank file is read: their files need only their names.
    """
    run = tmp / "run"
    for tag in ("global_step1", "global_step2"):
        (run / tag).mkdir(parents=True)
        (run / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (run / "latest").write_text("global_step3")
    return run


@pytest.mark.parametrize("command", ["inspect", "convert", "slim", "diff", "consolidate"])
def test_a_latest_naming_no_tag_is_fixed_by_what_every_command_takes(
    command: str, tmp_path: Path
) -> None:
    run = _save_folder(tmp_path)
    args: list[object] = [command, run]
    if command == "diff":
        args.append(run)
    elif command != "inspect":
        args.append(tmp_path / "out.pt")

    _, _, stderr = h.run_ckpt(*args, code=4)
    assert "names tag 'global_step3', which is not a folder" in stderr, stderr
    assert _named(stderr) <= _flags(command), stderr
    assert re.search(r"open a tag folder instead, e\.g\. \S+global_step1$", stderr.strip()), stderr
    assert not (tmp_path / "out.pt").exists()


def test_a_tag_option_naming_no_tag_names_the_tags_there(tmp_path: Path) -> None:
    run = _save_folder(tmp_path)
    out = tmp_path / "out.pt"
    # A bad argument, not a bad checkpoint: exit 2, as a --select naming nothing.
    _, _, stderr = h.run_ckpt("consolidate", run, out, "--tag", "global_step9", code=2)
    assert "--tag 'global_step9': not a folder in" in stderr, stderr
    assert "pass --tag global_step1, or pass --tag global_step2" in stderr, stderr

    # The tag it names is taken: what follows is about that tag's (empty) rank file.
    _, _, stderr = h.run_ckpt("consolidate", run, out, "--tag", "global_step1", code=None)
    assert "not a folder" not in stderr and "global_step1" in stderr, stderr

    with pytest.raises(UsageError) as info:
        ckpt_tools.consolidate(run, out, tag="global_step9")
    assert not isinstance(info.value, CorruptCheckpointError)
    assert "pass tag='global_step1', or pass tag='global_step2'" in str(info.value)
    assert not out.exists()


def test_reshard_takes_the_flags_its_refusals_name(tmp_path: Path) -> None:
    """A folder of pytorch_model*.bin shards may hold what safetensors shards cannot."""
    from safetensors.torch import load_file

    src = tmp_path / "hf"
    src.mkdir()
    torch.save({"a.weight": W, "step": 3, "f": Fraction(1, 3)}, src / "pytorch_model.bin")
    out = tmp_path / "out"
    base = ("reshard", src, out, "--max-shard-size", "1KB")

    _, _, stderr = h.run_ckpt(*base, code=3)
    assert "pass --allow-global fractions.Fraction" in stderr, stderr
    assert _named(stderr) <= _flags("reshard"), stderr
    _, _, stderr = h.run_ckpt(*base, "--allow-global", "fractions.Fraction", code=7)
    assert "2 non-tensor entries: step, f" in stderr and "pass --drop-extras" in stderr, stderr
    assert _named(stderr) <= _flags("reshard"), stderr
    assert not out.exists()

    _, stdout, _ = h.run_ckpt(*base, "--allow-global", "fractions.Fraction", "--drop-extras")
    assert re.search(r"^left out: step, f$", stdout, re.M), stdout
    got = load_file(out / "model.safetensors")
    assert list(got) == ["a.weight"] and torch.equal(got["a.weight"], W)

    keywords = inspect.signature(ckpt_tools.reshard).parameters
    assert {"drop_extras", "allow_globals"} <= set(keywords)


def _complex_half(tmp: Path) -> Path:
    """A state dict whose one tensor has a dtype safetensors cannot hold."""
    with warnings.catch_warnings():  # (torch calls complex32 experimental)
        warnings.simplefilter("ignore")
        torch.save({"module.a.weight": torch.zeros(2, dtype=torch.complex32)}, tmp / "in.pt")
    return tmp / "in.pt"


def _equal_complex_halves(tmp: Path) -> list[object]:
    """Two inputs whose mean keeps a tensor safetensors cannot hold (complex32, copied)."""
    for name, scale in (("a.pt", 1.0), ("b.pt", 2.0)):
        with warnings.catch_warnings():  # (torch calls complex32 experimental)
            warnings.simplefilter("ignore")
            half = torch.zeros(2, dtype=torch.complex32)
        torch.save({"w": torch.arange(3.0) * scale, "c": half}, tmp / name)
    return ["average", tmp / "a.pt", tmp / "b.pt"]


#: command -> its command line up to OUT, for an input safetensors cannot hold.
TORCH_ONLY: dict[str, Callable[[Path], list[object]]] = {
    "strip-module": lambda t: ["strip-module", _complex_half(t)],
    "add-module": lambda t: ["add-module", _complex_half(t)],
    "rename": lambda t: ["rename", "--sub", "module.=m.", _complex_half(t)],
    "convert": lambda t: ["convert", _complex_half(t)],
    "average": _equal_complex_halves,
}


@pytest.mark.parametrize("command", sorted(TORCH_ONLY))
def test_a_safetensors_name_that_cannot_hold_the_output_is_answered_with_a_torch_name(
    command: str, tmp_path: Path
) -> None:
    """``--format torch`` would be refused under a .safetensors name: the fix is the name."""
    args = TORCH_ONLY[command](tmp_path)
    _, _, stderr = h.run_ckpt(*args, tmp_path / "out.safetensors", code=7)
    assert "safetensors cannot hold" in stderr, stderr
    assert _named(stderr) <= _flags(command) and "--format" not in stderr, stderr
    assert stderr.rstrip().endswith(f"keep the torch format: name the output '{tmp_path}/out.pt'")
    assert not list(tmp_path.glob("*out.safetensors*"))
    h.run_ckpt(*args, tmp_path / "out.pt")  # the name it gives is written


@pytest.mark.parametrize("command", ["convert", "average"])
def test_format_safetensors_that_cannot_hold_the_output_is_answered_with_format_torch(
    command: str, tmp_path: Path
) -> None:
    args = TORCH_ONLY[command](tmp_path)
    out = tmp_path / "out"
    _, _, stderr = h.run_ckpt(*args, out, "--format", "safetensors", code=7)
    assert stderr.rstrip().endswith("pass --format torch to keep it in torch format"), stderr
    assert _named(stderr) <= _flags(command), stderr
    h.run_ckpt(*args, out, "--format", "torch")
    assert torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    ("option", "argument"), [("--select", "select"), ("--select-b", "select_b")]
)
def test_a_diff_selection_naming_no_entry_is_said_as_the_option_given(
    option: str, argument: str, tmp_path: Path
) -> None:
    src = _plain(tmp_path)
    _, _, stderr = h.run_ckpt("diff", src, src, option, "nope", code=2)
    assert stderr.startswith(f"ckpt: error: {option} 'nope': no entry 'nope'"), stderr

    with pytest.raises(SelectError) as info:
        ckpt_tools.diff(src, src, **{argument: "nope"})
    assert str(info.value).startswith(f"{argument}='nope': no entry 'nope'")
    assert info.value.argument in inspect.signature(ckpt_tools.diff).parameters


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--tag", "global_step1"], "--tag 'global_step1'"),
        (["--exclude-frozen"], "--exclude-frozen"),
    ],
)
def test_deepspeed_options_on_a_dcp_folder_are_said_as_options(
    args: list[str], said: str, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # (saving without a process group warns)
        warnings.simplefilter("ignore")
        dcp.save({"model": {"a.weight": W}}, checkpoint_id=str(tmp_path / "run"))
    out = tmp_path / "out.pt"
    _, _, stderr = h.run_ckpt("consolidate", tmp_path / "run", out, *args, code=2)
    assert stderr.startswith(f"ckpt: error: {said}: for DeepSpeed checkpoints only"), stderr
    assert "=" not in stderr.split(":")[2], stderr  # no Python argument=value on the command line
    with pytest.raises(UsageError, match=r"^tag='global_step1': for DeepSpeed checkpoints only"):
        ckpt_tools.consolidate(tmp_path / "run", out, tag="global_step1")
    assert not out.exists()


# --- every flag a remedy names is some command's option --------------------------------------


def _literal_parts(node: ast.expr) -> list[str]:
    """The literal text of a str expression: a constant, an f-string's first part (where the
    option is; later parts are values), or both arms of a conditional expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr) and node.values:
        return _literal_parts(node.values[0])
    if isinstance(node, ast.IfExp):
        return _literal_parts(node.body) + _literal_parts(node.orelse)
    return []


def _template(node: ast.expr) -> str:
    """A command's text with each interpolated value as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_template(part) for part in node.values)
    return "{}"


def _remedy_texts() -> tuple[dict[str, str], dict[str, str]]:
    """``flag=`` literals (of a Remedy or an error) and Remedy ``command=`` texts in the
    package's source, each with where it is written."""
    flags: dict[str, str] = {}
    commands: dict[str, str] = {}
    for path in sorted((h.ROOT / "ckpt_tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            keywords = {k.arg: k.value for k in node.keywords if k.arg}
            if name == "Remedy" and len(node.args) >= 3:  # Remedy(argument, value, flag)
                keywords.setdefault("flag", node.args[2])
            where = f"{path.relative_to(h.ROOT)}:{node.lineno}"
            for text in _literal_parts(keywords["flag"]) if "flag" in keywords else []:
                flags[text] = where
            if name == "Remedy" and "command" in keywords:
                commands[_template(keywords["command"])] = where
    return flags, commands


def _all_options(group: click.Group = cli) -> dict[str, set[str]]:
    """Each command's option strings (``--no-...`` forms included), ``harness train`` too."""
    context = click.Context(group)
    found: dict[str, set[str]] = {}
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        assert command is not None
        if isinstance(command, click.Group):
            found.update({f"{name} {k}": v for k, v in _all_options(command).items()})
            continue
        found[name] = {
            o
            for p in command.params
            if isinstance(p, click.Option)
            for o in p.opts + p.secondary_opts
        }
    return found


def test_every_flag_a_remedy_names_is_an_option_of_some_command() -> None:
    """A flag is written as its option, then a value: ``--select a.b``, ``--format torch``."""
    flags, _ = _remedy_texts()
    declared = set().union(*_all_options().values())
    options = {text: text.split()[0] if text.strip() else text for text in flags}
    assert all(o.startswith("--") for o in options.values()), flags
    unknown = {text: flags[text] for text, o in options.items() if o not in declared}
    assert not unknown, unknown
    # Not vacuous: the collection finds the flags named everywhere, with or without a value.
    found = set(options.values())
    assert len(found) > 30 and {"--force", "--in-place", "--drop-extras", "--tag"} <= found, found
    assert {"--format torch", "--select a.b", "--ints first"} <= set(flags), flags


def test_every_ckpt_command_a_remedy_gives_exists_with_its_options() -> None:
    _, commands = _remedy_texts()
    options = _all_options()
    given = {text: where for text, where in commands.items() if text.startswith("ckpt ")}
    assert len(given) >= 5, commands
    for text, where in given.items():
        name = text.split()[1]
        assert name in options, (where, text)
        named = set(re.findall(r"(?<!\S)--[a-z][a-z0-9-]*", text))
        assert named <= options[name], (where, text, named - options[name])


def test_a_remedy_with_a_value_names_the_argument_it_is_for() -> None:
    """``Remedy(flag="--tag", value="'a'")`` would print ``pass --tag``: the value is shown
    only as ``argument=value`` (Python) and belongs in the flag's text on the command line."""
    found, loose = 0, []
    for path in sorted((h.ROOT / "ckpt_tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Remedy"):
                continue
            given = {k.arg for k in node.keywords}
            given |= set(("argument", "value", "flag")[: len(node.args)])
            found += 1
            if "value" in given and "argument" not in given:
                loose.append(f"{path.relative_to(h.ROOT)}:{node.lineno}")
    assert found > 50 and not loose, loose
