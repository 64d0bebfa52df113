"""Errors speak to their reader: Python arguments to a library caller, flags on the command line.

Each failure below is a real one, triggered through the library and through ``ckpt`` on real
files. The library's words must name the Python argument and not the flag, the command line's
the flag and not the Python argument, the structured fields must be set, and following the
remedy must make the call succeed.
"""

from __future__ import annotations

import argparse
import ast
import errno
import inspect
import pickle
import re
from pathlib import Path

import pytest
import torch

from ckpt_tools import open_checkpoint
from ckpt_tools.cli.commands.rewrite import convert_cmd, strip_module_cmd
from ckpt_tools.cli.main import main
from ckpt_tools.errors import (
    EXIT_CONVERSION,
    EXIT_CORRUPT,
    EXIT_OUTPUT,
    EXIT_RESOURCE,
    EXIT_UNSAFE,
    EXIT_USAGE,
    CheckpointError,
    CheckpointNotFoundError,
    LfsPointerError,
    NonTensorEntriesError,
    OutputError,
    OutputExistsError,
    Remedy,
    ResourceLimitError,
    SameFileError,
    SelectError,
    UnsafeContentError,
    UsageError,
    VerificationError,
)
from ckpt_tools.harness.placement import resolve_devices
from ckpt_tools.ops.rewrite.conversion import convert
from ckpt_tools.ops.rewrite.rewriting import rewrite, strip_module

PACKAGE = Path(__file__).resolve().parent.parent / "ckpt_tools"


def _weights() -> dict[str, torch.Tensor]:
    return {"module.fc.weight": torch.arange(6.0).reshape(2, 3), "module.fc.bias": torch.ones(2)}


def _saved(tmp_path: Path, obj: object, name: str = "in.pt") -> Path:
    path = tmp_path / name
    torch.save(obj, path)
    return path


def _cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _flags(command: object) -> set[str]:
    """Every option string a click command accepts."""
    return {opt for param in command.params for opt in param.opts}  # type: ignore[attr-defined]


def _rewrite_arguments() -> set[str]:
    return set(inspect.signature(rewrite).parameters)


# --- the representative failures, both ways ---------------------------------------------------


def test_existing_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _saved(tmp_path, _weights())
    dst = tmp_path / "out.pt"
    dst.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match=r"already exists; pass force=True") as info:
        convert(src, dst)
    err = info.value
    assert "--force" not in str(err)
    assert err.path == str(dst) and err.exit_code == EXIT_OUTPUT
    assert err.remedies[0].argument == "force" and err.remedies[0].value == "True"
    assert err.remedies[0].argument in _rewrite_arguments()
    assert err.remedies[0].flag in _flags(convert_cmd)

    code, stderr = _cli(capsys, "convert", src, dst)
    assert code == EXIT_OUTPUT
    assert "already exists; pass --force to replace it, or choose another output path" in stderr
    assert "force=True" not in stderr
    assert dst.read_bytes() == b"precious"
    # The remedy is true: with it, the same call succeeds.
    assert convert(src, dst, force=True).written


def test_same_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _saved(tmp_path, _weights())
    link = tmp_path / "link.pt"
    link.hardlink_to(src)
    with pytest.raises(SameFileError, match=r"is the input file.*pass in_place=True") as info:
        convert(src, link)
    err = info.value
    assert "--in-place" not in str(err)
    assert err.path == str(link)
    assert err.remedies[0].argument == "in_place" in _rewrite_arguments()
    assert err.remedies[0].flag in _flags(convert_cmd)

    code, stderr = _cli(capsys, "convert", src, link)
    assert code == EXIT_OUTPUT
    assert "pass --in-place to rewrite it" in stderr and "in_place" not in stderr
    assert convert(src, src, in_place=True).written


def test_select_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _saved(tmp_path, {"model": _weights(), "epoch": 3})
    with pytest.raises(
        SelectError, match=r"^select='nope': no entry 'nope' under the root"
    ) as info:
        strip_module(src, tmp_path / "out.pt", select="nope")
    err = info.value
    assert "--select" not in str(err)
    assert (err.argument, err.value, err.flag) == ("select", "'nope'", "--select")
    assert err.argument in _rewrite_arguments() and err.flag in _flags(strip_module_cmd)

    code, stderr = _cli(capsys, "strip-module", src, tmp_path / "out.pt", "--select", "nope")
    assert code == EXIT_USAGE
    assert "ckpt: error: --select 'nope': no entry 'nope'" in stderr
    assert "select=" not in stderr


def test_unsafe_global(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _saved(tmp_path, {"state_dict": _weights(), "args": argparse.Namespace(lr=0.1)})
    dst = tmp_path / "out.pt"
    with pytest.raises(UnsafeContentError, match=r"argparse\.Namespace") as info:
        convert(src, dst)
    err = info.value
    assert "pass allow_globals=['argparse.Namespace'] to carry them through" in str(err)
    assert "--allow-global" not in str(err)
    assert err.globals == ("argparse.Namespace",) and err.path == str(src)
    remedy = err.remedies[0]
    assert remedy.argument == "allow_globals" in _rewrite_arguments()
    assert remedy.flag is not None and remedy.flag.split()[0] in _flags(convert_cmd)

    code, stderr = _cli(capsys, "convert", src, dst)
    assert code == EXIT_UNSAFE
    assert "pass --allow-global argparse.Namespace to carry them through" in stderr
    assert "allow_globals" not in stderr
    # Both spellings of the remedy work.
    assert main(["convert", str(src), str(dst), *remedy.flag.split(), "-q"]) == 0
    allowed = ast.literal_eval(remedy.value or "")
    assert convert(src, dst, force=True, allow_globals=allowed).written


def test_non_tensor_entries_to_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _saved(tmp_path, {**_weights(), "epoch": 3})
    dst = tmp_path / "out.safetensors"
    with pytest.raises(NonTensorEntriesError, match=r"1 non-tensor entry: epoch") as info:
        convert(src, dst)
    err = info.value
    assert "pass drop_extras=True to leave it out, or keep the torch format" in str(err)
    assert "--drop-extras" not in str(err)
    assert err.entries == ("epoch",) and err.path == str(src)
    assert err.remedies[0].argument == "drop_extras" and err.remedies[0].flag in _flags(convert_cmd)
    assert isinstance(err, ValueError)

    code, stderr = _cli(capsys, "convert", src, dst)
    assert code == EXIT_CONVERSION
    assert "pass --drop-extras to leave it out" in stderr and "drop_extras" not in stderr
    assert not dst.exists()
    assert convert(src, dst, drop_extras=True).dropped == ("epoch",)


def test_lfs_pointer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pointer = tmp_path / "model.safetensors"
    pointer.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:658bf57ed30d22120177cda107e513c0712db1b4324528cc4f65cdf562248e3e\n"
        "size 1234\n"
    )
    with pytest.raises(LfsPointerError, match="git-lfs pointer") as info:
        open_checkpoint(pointer)
    err = info.value
    assert err.path == str(pointer)
    assert err.remedies == (
        Remedy(command="git lfs pull", text="in its repository to fetch the real file"),
    )
    # A command is the same fix for both readers.
    assert str(err) == err.render(for_cli=True)
    assert str(err).endswith("; run `git lfs pull` in its repository to fetch the real file")

    code, stderr = _cli(capsys, "inspect", pointer)
    assert code == EXIT_CORRUPT and "run `git lfs pull`" in stderr


def test_harness_arguments_both_ways() -> None:
    with pytest.raises(UsageError) as info:
        resolve_devices(2, device="tpu")
    assert str(info.value) == "device='tpu': expected 'cpu' or 'cuda'"
    assert info.value.render(for_cli=True) == "--device 'tpu': expected 'cpu' or 'cuda'"


# --- the pieces -------------------------------------------------------------------------------


def test_remedy_renders_only_where_it_applies() -> None:
    python_only = Remedy("trust", "True", text="if you trust the file")
    flag_only = Remedy(verb="leave out", flag="--plot")
    both = Remedy("world_size", verb="lower", flag="--world-size")
    assert python_only.render() == "pass trust=True if you trust the file"
    assert python_only.render(for_cli=True) is None
    assert flag_only.render() is None and flag_only.render(for_cli=True) == "leave out --plot"
    assert (both.render(), both.render(for_cli=True)) == ("lower world_size", "lower --world-size")
    assert Remedy(text="choose another output path").render() == "choose another output path"

    err = UsageError("bad", remedies=(python_only, flag_only, both))
    assert str(err) == "bad; pass trust=True if you trust the file, or lower world_size"
    assert err.render(for_cli=True) == "bad; leave out --plot, or lower --world-size"
    three = UsageError("bad", remedies=(both, both, python_only))
    assert (
        str(three)
        == "bad; lower world_size, lower world_size, or pass trust=True if you trust the file"
    )
    assert (
        str(UsageError("bad", remedies=(python_only,)))
        == "bad; pass trust=True if you trust the file"
    )
    assert UsageError("bad", remedies=(python_only,)).render(for_cli=True) == "bad"


def test_subject_prefix_needs_a_value() -> None:
    named = UsageError("must be at least 1", argument="steps", value="0", flag="--steps")
    assert (str(named), named.render(for_cli=True)) == (
        "steps=0: must be at least 1",
        "--steps 0: must be at least 1",
    )
    # No flag: the command line reads the Python spelling rather than nothing.
    python_only = UsageError("must be >= 1 or None", argument="threads", value="0")
    assert python_only.render(for_cli=True) == "threads=0: must be >= 1 or None"
    # A switch is named alone on the command line; Python still reads its value.
    switch = UsageError("is for DeepSpeed", argument="include_all", value="True", flag="--all")
    assert (str(switch), switch.render(for_cli=True)) == (
        "include_all=True: is for DeepSpeed",
        "--all: is for DeepSpeed",
    )
    # An argument without a value is data only; the message already says it.
    assert str(UsageError("gpus and device contradict", argument="gpus")) == (
        "gpus and device contradict"
    )


def test_verification_error_says_the_output_was_not_kept_once() -> None:
    err = VerificationError("'w' reads back as float16", path="out.pt")
    assert str(err) == "'w' reads back as float16; the output was not kept"
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.path == "out.pt"


@pytest.mark.parametrize(
    "err",
    [
        OutputExistsError("out.pt"),
        SameFileError(Path("out.pt")),
        UnsafeContentError("bad", ("posix.system",), path="a.pt", remedies=(Remedy("x", "1"),)),
        SelectError("no entry", argument="select", value="'a'", flag="--select"),
        NonTensorEntriesError("extras", ("epoch",), path="a.pt"),
        CheckpointNotFoundError("gone", path="a.pt"),
    ],
)
def test_errors_survive_pickling(err: CheckpointError) -> None:
    # Errors cross process boundaries (the harness's DDP workers, multiprocessing pools).
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err)
    assert str(again) == str(err) and again.render(for_cli=True) == err.render(for_cli=True)
    assert (again.path, again.argument, again.remedies) == (err.path, err.argument, err.remedies)
    if isinstance(err, OSError):  # the built-in's fields too
        assert (again.errno, again.filename) == (err.errno, err.filename)


def test_built_in_parents_still_catch() -> None:
    with pytest.raises(KeyError):
        raise SelectError("no entry 'x'", argument="select", value="'x'")
    with pytest.raises(ValueError):
        raise SelectError("no entry 'x'")
    with pytest.raises(FileExistsError):
        raise OutputExistsError("out.pt")
    with pytest.raises(OSError):
        raise SameFileError("out.pt")
    with pytest.raises(OSError):
        raise OutputError("disk full", path="out.pt")
    with pytest.raises(pickle.UnpicklingError):
        raise UnsafeContentError("bad", ("posix.system",))
    # KeyError would quote its message, OSError prefix an errno: neither does here.
    assert str(SelectError("no entry 'x'")) == "no entry 'x'"
    assert str(OutputError("disk full")) == "disk full"


def test_a_refused_file_is_not_out_of_memory() -> None:
    """A handler for MemoryError (running out of memory) does not catch a refused input."""
    err = ResourceLimitError("more than 10 wrapper prefixes")
    assert isinstance(err, ValueError) and not isinstance(err, MemoryError)
    assert err.exit_code == EXIT_RESOURCE
    with pytest.raises(ResourceLimitError):
        try:
            raise err
        except MemoryError:  # pragma: no cover - the point is that this does not run
            pytest.fail("ResourceLimitError was caught as a MemoryError")


def test_leaf_signatures_keep_working() -> None:
    assert UnsafeContentError("m", ("a.b",)).globals == ("a.b",)
    assert NonTensorEntriesError("m", ("epoch",)).entries == ("epoch",)
    assert OutputExistsError(Path("o.pt")).path == "o.pt"


# --- no library message names a flag ---------------------------------------------------------

# Command-line code may name its own flags.
_CLI_FILES = {"cli", "harness/cli.py"}
_FLAG = re.compile(r"(?<![\w`-])--[a-z][a-z-]*")


def _message_literals(call: ast.Call) -> list[str]:
    """The string pieces of a raise's positional arguments (its message)."""
    texts = []
    for arg in call.args:
        for node in ast.walk(arg):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return texts


def test_no_library_message_names_a_flag() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.split("/")[0] in _CLI_FILES or relative in _CLI_FILES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                for text in _message_literals(node.exc):
                    # A command in backticks is the same for both readers.
                    outside_commands = re.sub(r"`[^`]*`", "", text)
                    if _FLAG.search(outside_commands):
                        offenders.append(f"{relative}:{node.lineno}: {text!r}")
    assert offenders == [], "pass the flag as Remedy(flag=...) instead:\n" + "\n".join(offenders)


def test_an_output_error_from_a_failed_write_carries_its_errno(tmp_path: Path) -> None:
    # A file size limit makes the write fail with EFBIG, as a full disk does with ENOSPC.
    import subprocess
    import sys

    torch.save({"w": torch.zeros(100_000)}, tmp_path / "in.pt")
    code = (
        "import errno, resource, signal, sys\n"
        "import ckpt_tools as ct\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    ct.convert({str(tmp_path / 'in.pt')!r}, {str(tmp_path / 'o.pt')!r})\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.errno == errno.EFBIG)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["OutputError", "True"], done.stderr
    assert SameFileError("x").errno is None  # a refusal has none
    assert OutputExistsError("x").errno == errno.EEXIST  # as the built-in FileExistsError
