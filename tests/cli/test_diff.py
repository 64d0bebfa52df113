"""``ckpt diff``: table, --json, --fail-on exit codes, --model file.py:Factory and --model-arg."""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.loading.module_spec import parse_value
from tests.helpers import run_ckpt
from tests.helpers.committed import fixture_path

NET_PY = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self, depth=2, width=4, scale=1.0, bias=True, act="relu"):
            super().__init__()
            assert isinstance(scale, float) and isinstance(bias, bool) and act == "gelu"
            self.layers = nn.ModuleList(nn.Linear(width, width, bias=bias) for _ in range(depth))


    def make_small():
        torch.manual_seed(0)
        return Net(depth=1, act="gelu")


    NOT_A_MODEL = 3
    """
)


@pytest.fixture
def files(tmp_path: Path) -> Callable[..., tuple[str, str]]:
    """Save two state dicts as a.pt and b.pt; returns their paths."""

    def _files(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str]:
        torch.save(a, tmp_path / "a.pt")
        torch.save(b, tmp_path / "b.pt")
        return str(tmp_path / "a.pt"), str(tmp_path / "b.pt")

    return _files


def base(n: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"blocks.{i}.weight": torch.randn(4, 4) for i in range(n)}


VARIANTS: dict[str, Callable[[dict[str, torch.Tensor]], None]] = {
    "missing": lambda sd: sd.update({"new.weight": torch.zeros(1)}),
    "unexpected": lambda sd: sd.pop("blocks.0.weight"),
    "shape": lambda sd: sd.update({"blocks.1.weight": torch.zeros(5, 4)}),
    "dtype": lambda sd: sd.update({"blocks.1.weight": sd["blocks.1.weight"].double()}),
    "value": lambda sd: sd["blocks.2.weight"].add_(1.0),
}


@pytest.mark.parametrize("present", list(VARIANTS))
@pytest.mark.parametrize("fail_on", list(VARIANTS))
def test_fail_on_exit_codes(
    present: str, fail_on: str, files: Callable[..., tuple[str, str]], capsys: Any
) -> None:
    b = base()
    VARIANTS[present](b)
    a_path, b_path = files(base(), b)
    code, out, _ = run_ckpt("diff", a_path, b_path, "--fail-on", fail_on, code=None)
    assert code == (1 if present == fail_on else 0)
    assert ("failing on: " + fail_on in out) == (present == fail_on)


def test_no_fail_on_exits_zero_and_any_fails(files: Any, capsys: Any) -> None:
    b = base()
    VARIANTS["value"](b)
    a_path, b_path = files(base(), b)
    assert run_ckpt("diff", a_path, b_path, code=None)[0] == 0
    assert run_ckpt("diff", a_path, b_path, "--fail-on", "any", code=None)[0] == 1
    assert run_ckpt("diff", a_path, a_path, "--fail-on", "any", code=None)[0] == 0


@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_a_cast_that_changed_the_values_fails_on_value(
    scale: float, files: Any, capsys: Any
) -> None:
    ref = base(1)
    cast = {k: (v * scale).bfloat16() for k, v in ref.items()}
    a_path, b_path = files(cast, ref)
    (a, b) = (cast["blocks.0.weight"].double(), ref["blocks.0.weight"].double())
    close = bool(torch.isclose(a, b, rtol=0, atol=1e-2).all())  # torch decides, in float64
    code, out, _ = run_ckpt(
        "diff", a_path, b_path, "--rtol", "0", "--atol", "1e-2", "--fail-on", "value", code=None
    )
    assert code == (0 if close else 1) and close == (scale == 1.0), out
    assert ("failing on: value" in out) != close


def test_fail_on_value_without_values_is_refused_or_noted(files: Any, capsys: Any) -> None:
    b = base()
    VARIANTS["value"](b)
    a_path, b_path = files(base(), b)
    refused = run_ckpt("diff", a_path, b_path, "--no-values", "--fail-on", "value", code=2)
    assert "--no-values" in refused.stderr
    noted = run_ckpt("diff", a_path, b_path, "--no-values", "--fail-on", "any", code=0)
    assert "values were not compared" in noted.stderr


def test_table_folds_repeated_layers_and_json_has_everything(files: Any, capsys: Any) -> None:
    b = base(6)
    for i in range(6):
        b[f"blocks.{i}.weight"] += 1e-3
    a_path, b_path = files(base(6), b)
    code, out, _ = run_ckpt("diff", a_path, b_path, "--atol", "1e-6", "--rtol", "0", code=None)
    assert code == 0
    assert "blocks.{0..5}.weight ×6  differ" in out
    code, out, _ = run_ckpt("diff", a_path, b_path, "--json", "--fail-on", "value", code=None)
    data = json.loads(out)
    assert code == 1 and data["failed_on"] == ["value"] and data["found"] == ["value"]
    assert len(data["tensors"]) == 6 and data["tensors"][0]["max_abs"] == pytest.approx(1e-3, 1e-2)
    code, out, _ = run_ckpt("diff", a_path, b_path, "--rtol", "1", "--all", "--no-group", code=None)
    assert "blocks.5.weight" in out and "close" in out


def test_suggestion_is_printed_with_the_command(files: Any, capsys: Any) -> None:
    a_path, b_path = files({"module." + k: v for k, v in base().items()}, base())
    code, out, _ = run_ckpt("diff", a_path, b_path, "--fail-on", "unexpected", code=None)
    assert code == 1
    assert "stripping 'module.' resolves 3 of 3 unexpected keys: ckpt strip-module " in out
    assert "compared 0 common tensors" in out


def test_align_compares_values_through_the_wrapper(files: Any, capsys: Any) -> None:
    b = base()
    VARIANTS["value"](b)
    a_path, b_path = files({"_orig_mod." + k: v for k, v in base().items()}, b)
    args = ["diff", a_path, b_path, "--align", "--fail-on", "missing,unexpected"]
    code, out, _ = run_ckpt(*args, code=None)
    assert code == 0
    assert "aligned: A's keys compared after stripping '_orig_mod.'" in out
    assert "compared 3 common tensors: 2 equal, 1 differ" in out
    assert "ckpt strip-module" in out  # how to make it permanent
    code, out, _ = run_ckpt(*args[:-1], "value", "--json", code=None)
    assert code == 1 and json.loads(out)["aligned"] == ["stripping '_orig_mod.'"]


def test_align_that_fixes_everything_suggests_nothing(capsys: Any) -> None:
    # dataparallel.pt is plain.pt's model under nn.DataParallel: --align strips 'module.'.
    ddp, plain = fixture_path("dataparallel.pt"), fixture_path("plain.pt")
    _, out, _ = run_ckpt("diff", ddp, plain, "--align", "--fail-on", "any")
    assert "identical: same keys, every tensor bit-equal" in out
    assert "suggestions" not in out and "add-module" not in out and "adding 'module.'" not in out
    assert out.count("ckpt strip-module") == 1  # once, in the aligned line
    _, out, _ = run_ckpt("diff", ddp, plain, "--align", "--json")
    assert json.loads(out)["suggestions"] == []
    _, out, _ = run_ckpt("diff", ddp, plain, code=None)  # without --align: the suggestion
    assert "suggestions:" in out and "adding 'module.' on B" in out


def test_sparse_and_nested_tensors_that_differ_fail_on_value(files: Any, capsys: Any) -> None:
    shared = torch.arange(2.0)
    coo = [torch.sparse_coo_tensor([[0, 1], [1, 0]], v, (2, 2)) for v in ([1.0, 2.0], [5.0, 7.0])]
    nested = [torch.nested.nested_tensor([torch.full((2,), v), torch.ones(3)]) for v in (1.0, 0.0)]
    assert not torch.equal(coo[0].to_dense(), coo[1].to_dense())
    a_path, b_path = files(
        {"dense": shared, "coo": coo[0], "nested": nested[0]},
        {"dense": shared, "coo": coo[1], "nested": nested[1]},
    )
    code, out, _ = run_ckpt("diff", a_path, b_path, "--fail-on", "any", code=None)
    assert code == 1 and "failing on: value" in out
    assert "identical" not in out and "non-tensor" not in out and "(torch-zip, 3 tensors)" in out
    code, out, _ = run_ckpt("diff", a_path, b_path, "--json", code=None)
    report = json.loads(out)
    assert code == 0 and report["identical"] is False and report["found"] == ["value"]
    assert [t["status"] for t in report["tensors"]] == ["equal", "differ", "differ"]
    _, out, _ = run_ckpt("diff", a_path, b_path, "--no-values", "--fail-on", "any", code=None)
    assert "identical" not in out


def test_a_layout_mismatch_fails_on_layout(files: Any, capsys: Any) -> None:
    a_path, b_path = files({"w": torch.eye(2).to_sparse()}, {"w": torch.eye(2)})
    code, out, _ = run_ckpt("diff", a_path, b_path, "--fail-on", "layout", code=None)
    assert code == 1 and "layouts differ: sparse_coo / strided" in out


def test_what_the_model_file_prints_goes_to_stderr_not_into_the_json(tmp_path: Path) -> None:
    noisy = "from torch import nn\nprint('importing')\n\n\ndef build():\n"
    noisy += "    print('building')\n    return nn.Linear(2, 2)\n"
    (tmp_path / "noisy.py").write_text(noisy)
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "lin.pt")
    spec = f"{tmp_path / 'noisy.py'}:build"
    for how in ("in-process", "module"):
        _, out, err = run_ckpt("diff", tmp_path / "lin.pt", "--model", spec, "--json", how=how)
        assert json.loads(out)["b"]["kind"] == "module"
        assert "importing" in err and "building" in err


def test_model_from_a_file_with_typed_args(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "net.py").write_text(NET_PY)
    spec = f"{tmp_path / 'net.py'}:Net"
    torch.manual_seed(0)
    sd = {
        f"layers.{i}.{p}": torch.randn(8, 8) if p == "weight" else torch.randn(8)
        for i in range(3)
        for p in ("weight", "bias")
    }
    torch.save({"state_dict": sd}, tmp_path / "ckpt.pt")
    ckpt = str(tmp_path / "ckpt.pt")
    args = ["--model-arg", "depth=3", "--model-arg", "width=8", "--model-arg", "scale=2.0"]
    args += ["--model-arg", "bias=true", "--model-arg", "act=gelu"]
    code, out, _ = run_ckpt(
        "diff", ckpt, "--model", spec, *args, "--fail-on", "missing,shape", code=None
    )
    assert code == 0, out
    assert f"B: {spec} <module Net>" in out and "state dict 'state_dict'" in out
    code, out, _ = run_ckpt("diff", ckpt, "--model", spec, *args, "--fail-on", "value", code=None)
    assert code == 1
    code, out, _ = run_ckpt("diff", ckpt, "--model", f"{tmp_path / 'net.py'}:make_small", code=None)
    assert "missing" not in out and "unexpected (in A, not in B): 4" in out


def test_model_from_an_importable_module(files: Any, capsys: Any) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    a_path, _ = files(lin.state_dict(), {})
    args = ["diff", a_path, "--model", "torch.nn:Linear", "--model-arg", "in_features=3"]
    code, out, _ = run_ckpt(*args, "--model-arg", "out_features=2", "--fail-on", "shape", code=None)
    assert code == 0 and "compared 2 common tensors" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "give B or --model"),
        (["B.pt", "--model", "x:y"], "exactly one"),
        (["--model", "nofactory"], "expected MODULE:FACTORY"),
        (["--model", "missing_file.py:Net"], "no such file"),
        (["--model", "NET:Nope"], "has no 'Nope'; callables there: Net, make_small"),
        (["--model", "NET:NOT_A_MODEL"], r"\(int\) is not a class or function"),
        (["--model", "NET:Net", "--model-arg", "depth"], "expected KEY=VALUE"),
        (["--model", "NET:Net", "--model-arg", "colour=3"], "does not take"),
        (["--model", "no_such_pkg_xyz:Net"], "cannot import 'no_such_pkg_xyz'"),
        (
            ["--model", "NET:Net", "--model-arg", "width=wide", "--model-arg", "act=gelu"],
            r"Net\(\*\*\{'width': 'wide', 'act': 'gelu'\}\) failed: TypeError: ",
        ),
        (["--model", "BROKEN:Net"], "importing .*broken.py' failed: ModuleNotFoundError: "),
        (
            ["--model", "QUITS_ON_IMPORT:make"],
            r"quits_on_import.py' failed: it called sys.exit\(3\)",
        ),
        (["--model", "QUITS_ON_CALL:make"], r"make\(\*\*\{\}\) failed: it called sys.exit\(3\)"),
        (["B.pt", "--rtol", "nan"], "--rtol nan: tolerances must be finite numbers >= 0"),
        (["B.pt", "--atol", "nan"], "--atol nan: tolerances must be finite numbers >= 0"),
        (["B.pt", "--atol", "inf"], "--atol inf: tolerances must be finite numbers >= 0"),
        (["B.pt", "--rtol", "-1"], "--rtol -1.0: tolerances must be finite numbers >= 0"),
        (["B.pt", "--fail-on", "vibes"], "unknown vibes"),
        (["B.pt", "--fail-on", "any,vibes"], "unknown vibes"),  # beside "any" too
        (["B.pt", "--fail-on", ","], "unknown empty list"),
        (["B.pt", "--model-arg", "a=1"], "--model-arg needs --model"),
    ],
)
def test_usage_errors_exit_2_with_a_fix(
    extra: list[str], message: str, tmp_path: Path, files: Any, capsys: Any
) -> None:
    (tmp_path / "net.py").write_text(NET_PY)
    (tmp_path / "broken.py").write_text("import no_such_pkg_xyz\n")
    # A model file that ends the process (sys.exit) at import, or when its factory is called.
    (tmp_path / "quits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "quits_on_call.py").write_text("import sys\n\ndef make():\n    sys.exit(3)\n")
    a_path, b_path = files(base(), base())
    files_named = {"NET": tmp_path / "net.py", "BROKEN": tmp_path / "broken.py"}
    files_named.update(
        {n: tmp_path / f"{n.lower()}.py" for n in ("QUITS_ON_IMPORT", "QUITS_ON_CALL")}
    )
    for name, path in files_named.items():
        extra = [e.replace(name, str(path)) for e in extra]
    extra = [b_path if e == "B.pt" else e for e in extra]
    code, _, err = run_ckpt("diff", a_path, *extra, code=None)
    assert code == 2 and err.count("\n") == 1, err
    assert __import__("re").search(message, err), err


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("raise RuntimeError('no GPU here')\n", "failed: RuntimeError: no GPU here"),
        ("def broken(:\n", "failed: SyntaxError: "),
        ("import sys\nsys.exit(3)\n", r"failed: it called sys.exit\(3\)"),
        ("import no_such_dependency_xyz\n", "failed: ModuleNotFoundError: .*no_such_dependency"),
    ],
    ids=["raises", "syntax", "exits", "missing-dependency"],
)
def test_an_importable_module_that_fails_to_import_is_a_usage_error(
    body: str, message: str, tmp_path: Path, files: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a file given by path: one line, exit 2, never the module's traceback or exit code.
    name = f"ckpt_spec_{tmp_path.name.lower()}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    a_path, _ = files(base(), base())
    code, _, err = run_ckpt("diff", a_path, "--model", f"{name}:Net", code=None)
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(f"importing '{name}' " + message, err), err
    assert "give a file instead" not in err  # the file would fail alike


def test_parse_value() -> None:
    assert [parse_value(v) for v in ("3", "-2", "0.5", "1e-3", "TRUE", "false", "none", "x")] == [
        3,
        -2,
        0.5,
        1e-3,
        True,
        False,
        None,
        "x",
    ]


@pytest.mark.parametrize(
    ("name", "keys"),
    [
        ("a.pt", ["enc=1.weight", "enc=1.bias", "head.w"]),  # an "=" in the prefix renamed
        ("-ddp.pt", ["module.encoder.weight", "module.encoder.bias", "module.head.w"]),
        # Files whose own prefix strip-module keeps unless it is named: the fix names it.
        ("pytorch_model.bin", ["model.encoder.weight", "model.encoder.bias", "model.head.w"]),
        (
            "adapter_model.bin",
            [f"base_model.model.{k}" for k in ("encoder.weight", "encoder.bias", "head.w")],
        ),
    ],
    ids=["equals-in-prefix", "dash-name", "transformers-name", "adapter-name"],
)
def test_the_suggested_command_runs_and_leaves_no_difference(
    tmp_path: Path, name: str, keys: list[str]
) -> None:
    t = torch.ones(2)
    torch.save(dict.fromkeys(keys, t), tmp_path / name)
    torch.save(dict.fromkeys(["encoder.weight", "encoder.bias", "head.w"], t), tmp_path / "b.pt")
    found = run_ckpt("diff", "--json", "--", name, "b.pt", how="module", cwd=tmp_path)
    command = json.loads(found.stdout)["suggestions"][0]["command"]
    args = shlex.split(command)
    assert args[0] == "ckpt"
    run_ckpt(*args[1:], how="module", cwd=tmp_path)
    renamed = args[3]  # ckpt VERB IN OUT ...
    run_ckpt("diff", renamed, "b.pt", "--fail-on", "missing,unexpected", how="module", cwd=tmp_path)


@pytest.mark.parametrize(
    ("keys_a", "keys_b"),
    [
        (
            ["model.head.w", "model.blocks.0.fc.w", "model.blocks.1.fc.w"],
            ["module.head.w", "module.blocks._orig_mod.0.fc.w", "module.blocks.1.fc.w"],
        ),
        (
            [
                "base_model.model.blocks.1.fc.w",
                "base_model.model.head.w",
                "base_model.model.blocks._checkpoint_wrapped_module.0.fc.w",
            ],
            ["blocks._fsdp_wrapped_module.1.fc.w", "blocks._fsdp_wrapped_module.0.fc.w", "head.w"],
        ),
    ],
    ids=["rename-inside-a-wrapper", "two-maps-on-one-prefix"],
)
def test_every_suggested_command_both_ways_runs_and_does_what_it_says(
    tmp_path: Path, keys_a: list[str], keys_b: list[str]
) -> None:
    # A rename inside a wrapper's prefix applies before the strip; a fix with a rule that
    # renames nothing (its command refused, its words untrue) is not suggested.
    t = torch.ones(2)
    torch.save(dict.fromkeys(keys_a, t), tmp_path / "a.pt")
    torch.save(dict.fromkeys(keys_b, t), tmp_path / "b.pt")
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    suggestions = json.loads(run_ckpt("diff", "--json", a, b).stdout)["suggestions"]
    ran = 0
    for suggestion in suggestions:
        for command, other in ((suggestion["command"], b), (suggestion["inverse_command"], a)):
            if not command:
                continue
            args = shlex.split(command)
            run_ckpt(*args[1:], "--force")
            if suggestion["resolved"] == suggestion["of"]:  # (a whole fix: no difference left)
                run_ckpt("diff", args[3], other, "--fail-on", "missing,unexpected")
            ran += 1
    assert ran
