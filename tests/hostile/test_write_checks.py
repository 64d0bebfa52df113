"""Rewrites run their safety checks before deciding there is "nothing to do", and keys keep
their types through every rewrite or are refused up front.

Every hostile input is a real file made with torch; outputs are read back with torch itself.
"""

from __future__ import annotations

import argparse
import collections
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools.errors import ConversionError, UnsafeContentError
from ckpt_tools.ops.rewrite.conversion import convert
from ckpt_tools.ops.rewrite.rewriting import add_module, rename, strip_module
from ckpt_tools.structure.keys import sub_rule
from tests.helpers import listing

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated:DeprecationWarning")

CKPT = str(Path(sys.executable).with_name("ckpt"))


def _ckpt(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CKPT, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def _unsafe(path: Path) -> Path:
    # argparse.Namespace is outside the allowlist: never imported, always refused.
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, path)
    return path


def _torchscript(path: Path) -> Path:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    return path


def _pickled_module(path: Path) -> Path:
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), path)
    return path


# (input maker, exit code, what the one stderr line says)
HOSTILE = {
    "unsafe-globals": (_unsafe, 3, "outside the allowlist: argparse.Namespace"),
    "torchscript": (_torchscript, 7, "is a TorchScript archive"),
    # A pickled nn.Module: a .pt output would carry the module objects, so their classes are refused
    # (exit 3); with them allowed, exit 7 below. Converting to safetensors writes the
    # recovered state dict instead (tests/structure/test_modules.py).
    "pickled-module": (_pickled_module, 3, "outside the allowlist: torch.nn.modules.container"),
}
COMMANDS = {
    "strip-module": ("strip-module", "out.pt"),
    "add-module": ("add-module", "out.pt"),
    "rename": ("rename", "out.pt", "--sub", "nothing.=matches."),
    "convert": ("convert", "out.safetensors"),
}


@pytest.mark.parametrize(
    ("kind", "command"),
    # A pickled module converts to safetensors (tests/structure/test_modules.py).
    [(k, c) for k in HOSTILE for c in COMMANDS if (k, c) != ("pickled-module", "convert")],
)
def test_every_rewrite_refuses_before_looking_for_work(kind, command, tmp_path):
    make, code, says = HOSTILE[kind]
    src = make(tmp_path / "in.pt")
    name, dst, *extra = COMMANDS[command]
    result = _ckpt(name, src, tmp_path / dst, *extra)
    assert result.returncode == code, result.stderr
    assert says in result.stderr.splitlines()[0]
    assert listing(tmp_path) == ["in.pt"]  # nothing written, no temp file left


def test_pickled_module_refusal_names_the_fix(tmp_path):
    src = _pickled_module(tmp_path / "in.pt")
    classes = ["torch.nn.modules.container.Sequential", "torch.nn.modules.linear.Linear"]
    with pytest.raises(UnsafeContentError, match=r"container\.Sequential"):
        strip_module(src, tmp_path / "out.pt")
    with pytest.raises(ConversionError, match=r"ckpt sanitize .*in.pt OUT.pt.*state_dict\(\)"):
        strip_module(src, tmp_path / "out.pt", allow_globals=classes)
    allowed = [arg for name in classes for arg in ("--allow-global", name)]
    result = _ckpt("strip-module", src, tmp_path / "out.pt", *allowed)
    assert result.returncode == 7, result.stderr
    assert "weights_only=False" in result.stderr and "state_dict()" in result.stderr


def test_library_refuses_unsafe_and_torchscript_with_nothing_to_strip(tmp_path):
    with pytest.raises(UnsafeContentError, match=r"argparse\.Namespace"):
        strip_module(_unsafe(tmp_path / "u.pt"), tmp_path / "out.pt")
    with pytest.raises(ConversionError, match="TorchScript"):
        strip_module(_torchscript(tmp_path / "ts.pt"), tmp_path / "out.pt")
    # Allowed globals pass the check; then there is nothing to strip, and nothing is written.
    result = strip_module(
        tmp_path / "u.pt", tmp_path / "out.pt", allow_globals=["argparse.Namespace"]
    )
    assert not result.written and not (tmp_path / "out.pt").exists()


# --------------------------------------------------------------------------------------------
# Keys that are not strings
# --------------------------------------------------------------------------------------------


def _odd_keys(path: Path) -> dict:
    sd = collections.OrderedDict()
    sd[0] = torch.arange(3.0)
    sd["0"] = torch.arange(3.0) + 10
    sd[(1, 2)] = torch.ones(2, dtype=torch.int64)
    sd[None] = torch.zeros(1, dtype=torch.bfloat16)
    sd[b"x"] = torch.full((2,), 7, dtype=torch.uint8)
    sd["module.fc.weight"] = torch.arange(4.0).reshape(2, 2)
    torch.save(sd, path)
    return sd


def _typed_keys(sd) -> list[tuple[type, object]]:
    return [(type(k), k) for k in sd]


def _assert_same(got, want) -> None:
    assert _typed_keys(got) == _typed_keys(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize(
    "args",
    [
        ("rename", "--regex", r"^module\.="),
        ("strip-module", "--prefix", "module."),
        ("rename", "--sub", "module.="),
    ],
)
def test_keys_keep_their_types_through_rewrites(args, tmp_path):
    sd = _odd_keys(tmp_path / "in.pt")
    dst = tmp_path / "out.pt"
    result = _ckpt(args[0], tmp_path / "in.pt", dst, *args[1:])
    assert result.returncode == 0, result.stderr
    want = {("fc.weight" if k == "module.fc.weight" else k): v for k, v in sd.items()}
    _assert_same(torch.load(dst, weights_only=True), want)
    _assert_same(torch.load(dst, weights_only=True, mmap=True), want)


def test_one_prefixed_key_among_plain_ones_is_no_wrapper(tmp_path):
    # The str key "0" is a top-level module's (nn.Sequential): DataParallel would have
    # prefixed it too, so strip-module finds no wrapper to strip and writes nothing.
    _odd_keys(tmp_path / "in.pt")
    result = _ckpt("strip-module", tmp_path / "in.pt", tmp_path / "out.pt")
    assert result.returncode == 0 and "nothing to strip" in result.stdout + result.stderr
    assert listing(tmp_path) == ["in.pt"]


def test_a_rule_that_would_rename_a_non_str_key_is_refused_up_front(tmp_path):
    _odd_keys(tmp_path / "in.pt")
    result = _ckpt("add-module", tmp_path / "in.pt", tmp_path / "out.pt")
    assert result.returncode == 7
    assert "rename string keys only" in result.stderr.splitlines()[0]
    with pytest.raises(ConversionError, match=r"rename string keys only.*0, \(1, 2\), None"):
        add_module(tmp_path / "in.pt", tmp_path / "out.pt")
    with pytest.raises(ConversionError, match=r"b'x'"):  # str(b"x") starts with "b"
        rename(tmp_path / "in.pt", tmp_path / "out.pt", rules=[sub_rule("b", "c")])
    assert listing(tmp_path) == ["in.pt"]


def test_safetensors_conversion_refuses_non_str_keys_up_front(tmp_path):
    _odd_keys(tmp_path / "in.pt")
    result = _ckpt("convert", tmp_path / "in.pt", tmp_path / "out.safetensors")
    assert result.returncode == 7
    assert "safetensors names tensors by strings" in result.stderr.splitlines()[0]
    with pytest.raises(ConversionError, match=r"4 tensor\(s\) under other keys"):
        convert(tmp_path / "in.pt", tmp_path / "out.safetensors")
    assert listing(tmp_path) == ["in.pt"]


@pytest.mark.parametrize("command", ["convert", "strip-module", "slim"])
def test_a_name_that_is_no_utf8_is_refused_before_a_safetensors_output(command, tmp_path):
    # torch keeps a key with a lone surrogate; safetensors' header is UTF-8 and cannot.
    torch.save({"module.w\ud800": torch.ones(2), "module.b": torch.zeros(1)}, tmp_path / "in.pt")
    assert next(iter(torch.load(tmp_path / "in.pt", weights_only=True))) == "module.w\ud800"
    result = _ckpt(command, tmp_path / "in.pt", tmp_path / "out.safetensors")
    assert result.returncode == 7, result.stderr
    assert "safetensors names tensors in UTF-8, and 1 name(s)" in result.stderr
    assert "'module.w\\ud800'" in result.stderr or "'w\\ud800'" in result.stderr
    assert listing(tmp_path) == ["in.pt"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing torch._dynamo
@pytest.mark.parametrize("where", ["root", "entry"])
def test_a_pickled_compiled_module_is_refused_as_a_pickled_module(
    tmp_path: Path, where: str
) -> None:
    # torch.compile's wrapper pickles as a call on the module it wraps: a module all the same,
    # which a .pt rewrite cannot carry through (its attributes, its dynamo context).
    compiled = torch.compile(torch.nn.Linear(2, 2))
    torch.save(compiled if where == "root" else {"model": compiled}, tmp_path / "c.pt")
    refused = _ckpt("strip-module", tmp_path / "c.pt", tmp_path / "out.pt")
    assert refused.returncode == 3 and "ckpt sanitize" in refused.stderr, refused.stderr
    assert "--allow-global" not in refused.stderr and not (tmp_path / "out.pt").exists()


def test_the_fix_offered_for_a_pickled_module_is_the_one_that_works(tmp_path: Path) -> None:
    # Allowing the module's classes would only meet the pickled-module refusal (exit 7):
    # the suggested command, pasted as printed, writes its state dict instead. The name
    # starts with "-" and holds a space, as the suggestion must survive both.
    src = _pickled_module(tmp_path / "-whole model.pt")
    refused = _ckpt("strip-module", "--", "-whole model.pt", "out.pt", cwd=tmp_path)
    assert refused.returncode == 3, refused.stderr
    assert "--allow-global" not in refused.stderr
    command = refused.stderr.split("`")[1]
    assert command == "ckpt sanitize './-whole model.pt' OUT.pt"
    _, *args = shlex.split(command.replace("OUT.pt", "sanitized.pt"))
    assert _ckpt(*args, cwd=tmp_path).returncode == 0
    got = torch.load(tmp_path / "sanitized.pt", weights_only=True)
    want = torch.load(src, weights_only=False).state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
