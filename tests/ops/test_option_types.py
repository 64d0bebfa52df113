"""Sequence and mapping options of the public operations: one str (or one rule) where a
sequence is expected is that one item, and a wrong type is a UsageError naming the argument,
before anything is read or written. Outputs are read back with ``torch.load``.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import UsageError
from ckpt_tools.ops.average.averaging import pick_inputs


@pytest.fixture
def lightning(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "in.pt"
    state = {
        "state_dict": {"fc.weight": torch.randn(4, 4), "norm.weight": torch.randn(4)},
        "optimizer_states": [{"state": {}, "param_groups": []}],
        "epoch": 3,
    }
    torch.save(state, path)
    return path


def test_a_single_str_is_one_item(lightning: Path, tmp_path: Path) -> None:
    out = tmp_path / "slim.pt"
    result = ct.slim(lightning, out, drop="optimizer_states", dtype="bf16", keep_dtype="norm")
    got = torch.load(out, weights_only=True)
    assert sorted(got) == ["epoch", "state_dict"] and "optimizer_states" in result.dropped
    assert got["state_dict"]["fc.weight"].dtype == torch.bfloat16
    assert got["state_dict"]["norm.weight"].dtype == torch.float32  # kept by the one regex
    ct.convert(lightning, tmp_path / "c.pt", allow_globals="collections.OrderedDict")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["epoch"] == 3


def test_a_single_rule_is_one_rule(lightning: Path, tmp_path: Path) -> None:
    ct.rename(lightning, tmp_path / "r.pt", rules=ct.sub_rule("fc.", "proj."))
    got = torch.load(tmp_path / "r.pt", weights_only=True)["state_dict"]
    assert sorted(got) == ["norm.weight", "proj.weight"]
    assert ct.rename_keys({"fc.w": 1}, ct.sub_rule("fc.", "proj.")) == {"proj.w": 1}


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda src, dst: ct.rename(src, dst, rules="fc.=proj."),
            r"rules='fc\.=proj\.': expected a KeyRule or a sequence of KeyRule.*got str",
        ),
        (
            lambda src, dst: ct.rename(src, dst, rules=[("fc.", "proj.")]),
            r"expected a KeyRule or a sequence of KeyRule.*got a list holding tuple",
        ),
        (
            lambda src, dst: ct.rewrite(src, dst, rules={"fc.": "proj."}),
            r"rules=\{'fc\.': 'proj\.'\}: expected a KeyRule.*got dict",
        ),
        (
            lambda src, dst: ct.retag(src, dst, mapping=[("cpu", "cpu")]),
            r"mapping=\[\('cpu', 'cpu'\)\]: expected a dict of saved tag -> new tag, got list",
        ),
        (
            lambda src, dst: ct.retag(src, dst, mapping={"cpu": 0}),
            r"expected a dict of saved tag -> new tag, got a dict with a key or value",
        ),
        (
            lambda src, dst: ct.slim(src, dst, drop=["optimizer_states", 3]),
            r"drop=.*expected a str or a sequence of str, got a list holding int 3",
        ),
        (
            lambda src, dst: ct.slim(src, dst, keep_dtype=None),
            r"keep_dtype=None: expected a str or a sequence of str, got NoneType",
        ),
        (
            lambda src, dst: ct.extract(src, dst, prefix="fc.", allow_globals=7),
            r"allow_globals=7: expected a str or a sequence of str, got int",
        ),
        (
            lambda src, dst: ct.strip_module(src, dst, allow_globals=b"x"),
            r"allow_globals=b'x': expected a str or a sequence of str, got bytes",
        ),
        (
            lambda src, dst: ct.convert(
                src, dst.with_suffix(""), max_shard_size=10, allow_globals=1.0
            ),
            r"allow_globals=1\.0: expected a str or a sequence of str, got float",
        ),
    ],
)
def test_a_wrong_type_is_a_usage_error_naming_the_argument(
    lightning: Path, tmp_path: Path, call, match: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UsageError, match=match):
        call(lightning, out / "o.pt")
    assert list(out.iterdir()) == []


def test_rename_keys_refuses_a_dict_of_renames() -> None:
    with pytest.raises(UsageError, match=r"rules=\{'fc\.': 'proj\.'\}: expected a KeyRule"):
        ct.rename_keys({"fc.w": 1}, {"fc.": "proj."})


@pytest.mark.parametrize(
    ("call", "refusal"),
    [
        (lambda src, dst: ct.slim(src, dst, dtype="int8"), "dtype='int8': expected one of: bf16,"),
        (
            lambda src, dst: ct.convert(src, dst, output_format="onnx"),
            "output_format='onnx': expected one of: torch, safetensors",
        ),
        (
            lambda src, dst: ct.strip_module(src, dst, verify="fast"),
            "verify='fast': expected one of: sizes, full, none",
        ),
    ],
)
def test_an_option_outside_its_values_is_refused_in_one_form(
    call, refusal: str, lightning: Path, tmp_path: Path
) -> None:
    # Each option with a fixed set of values names the argument, the value and every choice,
    # before anything is written.
    out = tmp_path / "out.pt"
    with pytest.raises(UsageError) as info:
        call(lightning, out)
    assert str(info.value).startswith(refusal)
    assert not out.exists()


def _path_parameters(func: Callable[..., Any]) -> list[str]:
    """The parameters of ``func`` that take a file or folder path."""
    params = inspect.signature(func).parameters.values()
    return [p.name for p in params if "StrPath" in str(p.annotation)]


PATH_TAKERS = sorted(
    name
    for name in ct.__all__
    if inspect.isfunction(getattr(ct, name)) and _path_parameters(getattr(ct, name))
)
#: The other arguments each needs; a new operation that takes a path must be added here.
REQUIRED: dict[str, dict[str, Any]] = {
    "extract": {"prefix": "fc."},
    "load_into": {"model": torch.nn.Linear(2, 2)},
    "rename": {"rules": [ct.sub_rule("fc.", "head.")]},
    "retag": {"mapping": {"cpu": "cpu"}},
}


@pytest.mark.parametrize("name", PATH_TAKERS)
def test_a_path_that_is_no_path_is_a_usage_error_naming_it(
    name: str, lightning: Path, tmp_path: Path
) -> None:
    # A file object, bytes or None where a path goes: the caller's error, named, before
    # anything is read or written (torch.load takes a file object; these read by path).
    func = getattr(ct, name)
    good = {"srcs": [lightning], "dst": tmp_path / "out", "adapter": tmp_path}
    params = _path_parameters(func)
    for wrong in (io.BytesIO(lightning.read_bytes()), None, str(lightning).encode()):
        for param in params:
            args = {p: wrong if p == param else good.get(p, lightning) for p in params}
            if param == "srcs":
                args[param] = [wrong]
            with pytest.raises(UsageError) as info:
                func(**args, **REQUIRED.get(name, {}))
            assert info.value.argument == param, (name, param, info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_bytes_for_a_paths_option_is_one_path_refused_by_name() -> None:
    for call, argument in (
        (lambda: ct.scan(b"x.pt"), "paths"),
        (lambda: ct.average(b"x.pt", "o.pt"), "srcs"),
    ):
        with pytest.raises(UsageError, match="got bytes") as info:
            call()
        assert info.value.argument == argument


def test_allow_globals_of_average_and_merge_lora_take_one_str_as_one_item(
    lightning: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.pt"
    other.write_bytes(lightning.read_bytes())
    ct.average([lightning, other], tmp_path / "mean.pt", allow_globals="collections.OrderedDict")
    assert "fc.weight" in ct.load_state_dict(tmp_path / "mean.pt")
    for func, args in (
        (ct.average, ([lightning, other], tmp_path / "x.pt")),
        (ct.merge_lora, (lightning, tmp_path, tmp_path / "y.pt")),
    ):
        with pytest.raises(UsageError) as info:
            func(*args, allow_globals=None)
        assert info.value.argument == "allow_globals"


def test_reshard_of_a_missing_path_says_it_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ct.CheckpointNotFoundError, match="no such file or folder"):
        ct.reshard(tmp_path / "model-hf-typo", f"{tmp_path}/out/", max_shard_size="1GB")


def test_a_tensor_asked_for_by_another_type_is_a_select_error(lightning: Path) -> None:
    with pytest.raises(ct.SelectError, match="no tensor 0 in"):
        ct.inspect(lightning).tensor(0)  # type: ignore[arg-type]


@pytest.mark.parametrize("jobs", ["2", 2.5, True, 0])
def test_a_count_that_is_no_count_is_a_usage_error_naming_it(
    jobs: object, lightning: Path, tmp_path: Path
) -> None:
    for call in (
        lambda: ct.convert(lightning, tmp_path / "c.safetensors", jobs=jobs),
        lambda: ct.convert(lightning, f"{tmp_path}/hf/", jobs=jobs),
        lambda: ct.diff(lightning, lightning, jobs=jobs),
        lambda: pick_inputs([str(lightning)], last=jobs),
    ):
        with pytest.raises(UsageError, match="expected a count of 1 or more"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]


def test_a_numpy_int_is_a_count() -> None:
    import numpy as np

    from ckpt_tools._types import count_of

    assert count_of(np.int64(2), "jobs") == 2 and type(count_of(np.int64(2), "jobs")) is int


def _flags(func: Callable[..., Any]) -> list[str]:
    """The parameters of ``func`` that take True or False (or None, for ``bool | None``)."""
    params = inspect.signature(func).parameters.values()
    return [p.name for p in params if p.annotation in ("bool", "bool | None")]


FLAGGED = sorted(
    (name, flag)
    for name in ct.__all__
    if inspect.isfunction(getattr(ct, name))
    for flag in _flags(getattr(ct, name))
)


@pytest.mark.parametrize(("name", "flag"), FLAGGED)
def test_a_flag_that_is_no_bool_is_a_usage_error_naming_it(name: str, flag: str) -> None:
    # "no" and "false" are truthy: taken as given they would write, or run a file's code,
    # where the caller asked for the opposite.
    func = getattr(ct, name)
    optional = inspect.signature(func).parameters[flag].annotation == "bool | None"
    expected = "expected True, False or None" if optional else "expected True or False"
    for wrong in ("no", "false", 0, *(() if optional else (None,))):
        with pytest.raises(UsageError, match=expected) as info:
            func(**{flag: wrong})
        assert info.value.argument == flag


def test_a_numpy_bool_is_a_flag(lightning: Path, tmp_path: Path) -> None:
    import numpy as np

    result = ct.strip_module(lightning, tmp_path / "o.pt", dry_run=np.True_)
    assert result.dry_run and not (tmp_path / "o.pt").exists()


def test_a_flag_given_as_text_neither_writes_nor_runs_code(
    lightning: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evil = Path(__file__).resolve().parents[2] / "fixtures" / "evil.pt"
    monkeypatch.chdir(tmp_path)  # (where evil.pt's payload would leave its marker)
    with pytest.raises(UsageError, match="trust='no'"):
        ct.load_state_dict(evil, trust="no")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="dry_run='false'"):
        ct.strip_module(lightning, tmp_path / "out.pt", dry_run="false")  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.pt"]
    assert len(FLAGGED) > 60  # (every public operation's flags, found by their annotation)
    assert {"fan_in_fan_out", "assign", "values"} <= {flag for _, flag in FLAGGED}
