"""diff(): keys, shapes, dtypes, values (NaN, -0.0, inf), streaming reads, suggestions."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ckpt_tools.diffing.engine import diff
from ckpt_tools.errors import KeyCollisionError, UsageError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.loading.tensor_io import iter_chunks, read_tensor
from tests.helpers import data_parallel, run_ckpt


def layers(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(n):
        sd[f"layers.{i}.weight"] = torch.randn(6, 5)
        sd[f"layers.{i}.bias"] = torch.randn(6)
    sd["head.weight"] = torch.randn(3, 6)
    return sd


@pytest.fixture
def save(tmp_path: Path) -> Callable[[Any, str], str]:
    def _save(obj: Any, name: str = "a.pt") -> str:
        path = tmp_path / name
        if name.endswith(".safetensors"):
            save_file(obj, path)
        else:
            torch.save(obj, path)
        return str(path)

    return _save


# --- values ---------------------------------------------------------------------------


def test_identical_files_are_identical(save: Callable[..., str]) -> None:
    report = diff(save(layers(), "a.pt"), save(layers(), "b.pt"))
    assert report.identical and report.found() == frozenset()
    assert all(t.status == "equal" and t.max_abs == 0 for t in report.tensors)


def test_jobs_sets_torch_threads_while_comparing_and_restores_them() -> None:
    sd = {"w": torch.arange(8.0)}
    before = torch.get_num_threads()
    seen: list[int] = []

    class Spy(dict):  # a state dict side that notes the thread count as it is read
        def items(self):  # type: ignore[override]
            seen.append(torch.get_num_threads())
            return super().items()

    assert diff(Spy(sd), sd, jobs=2).identical
    assert seen and set(seen) == {2} and torch.get_num_threads() == before
    with pytest.raises(UsageError, match=r"jobs=0: expected a count of 1 or more"):
        diff(sd, sd, jobs=0)
    assert torch.get_num_threads() == before


def test_nan_negative_zero_and_inf() -> None:
    nan, inf = math.nan, math.inf
    a = {
        "zeros": torch.tensor([0.0, 1.0]),
        "nans": torch.tensor([nan, 2.0, inf]),
        "nan_vs_number": torch.tensor([nan, 1.0]),
        "inf_signs": torch.tensor([inf, 1.0]),
    }
    b = {
        "zeros": torch.tensor([-0.0, 1.0]),
        "nans": torch.tensor([nan, 2.0, inf]),
        "nan_vs_number": torch.tensor([3.0, 1.0]),
        "inf_signs": torch.tensor([-inf, 1.0]),
    }
    rows = {t.name: t for t in diff(a, b).tensors}

    zeros = rows["zeros"]  # -0.0 == 0.0 in value, not in bits
    assert (zeros.bit_equal, zeros.allclose, zeros.max_abs, zeros.status) == (
        False,
        True,
        0.0,
        "close",
    )
    nans = rows["nans"]  # same NaN bits in the same place: equal, counted
    assert nans.bit_equal and nans.allclose and nans.max_abs == 0.0
    assert (nans.nan_a, nans.nan_b, nans.inf_a, nans.inf_b) == (1, 1, 1, 1)
    nan_vs_number = rows["nan_vs_number"]
    assert not nan_vs_number.allclose and nan_vs_number.mismatched == 1
    assert (nan_vs_number.nan_a, nan_vs_number.nan_b, nan_vs_number.status) == (1, 0, "differ")
    inf_signs = rows["inf_signs"]
    assert inf_signs.max_abs == math.inf and inf_signs.max_rel == math.inf
    assert inf_signs.to_json()["max_abs"] == "inf"


def test_tolerances_and_differences() -> None:
    a = {"w": torch.tensor([1.0, 2.0, 0.0]), "i": torch.tensor([1, 2, 3])}
    b = {"w": torch.tensor([1.0, 2.002, 0.0]), "i": torch.tensor([1, 2, 4])}
    w = {t.name: t for t in diff(a, b).tensors}["w"]
    assert w.max_abs == pytest.approx(0.002, rel=1e-3)
    assert w.max_rel == pytest.approx(0.001, rel=1e-3)
    assert not w.allclose and w.mismatched == 1
    loose = diff(a, b, rtol=1e-2)
    assert {t.name: t.allclose for t in loose.tensors} == {"w": True, "i": False}
    assert loose.found() == frozenset({"value"})
    with pytest.raises(UsageError, match="rtol=-1"):
        diff(a, b, rtol=-1)


@pytest.mark.parametrize("name", ["rtol", "atol"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_a_tolerance_that_is_not_a_finite_number_at_least_zero_is_refused(
    name: str, value: float
) -> None:
    # torch.isclose refuses NaN too; with one here a differing pair counted as close.
    a, b = {"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}
    if math.isnan(value):
        with pytest.raises(RuntimeError, match=name):
            torch.isclose(a["w"], b["w"], **{name: value})
    with pytest.raises(UsageError, match=rf"^{name}={value!r}: tolerances must be finite") as e:
        diff(a, b, **{name: value})
    assert (e.value.argument, e.value.flag) == (name, f"--{name}")


def test_max_rel_is_inf_where_b_is_zero_and_a_is_not() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 2.0])
    rel = (a - b).abs() / b.abs()
    row = diff({"w": a}, {"w": b}).tensor("w")
    assert row.max_rel == float(rel.max()) == math.inf and row.to_json()["max_rel"] == "inf"


def test_other_dtypes_and_large_values() -> None:
    big = torch.full((4,), 3e38)  # a finite tensor whose sum overflows
    a = {
        "big": big,
        "ints": torch.tensor([1, 2, 3]),
        "flags": torch.tensor([True, False]),
        "half_vs_float": torch.tensor([0.5, 1.0]).half(),
        "complex": torch.tensor([1 + 1j, 2 - 1j]),
        "bf16": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    }
    b = {
        "big": big.clone(),
        "ints": torch.tensor([1, 2, 5]),
        "flags": torch.tensor([True, True]),
        "half_vs_float": torch.tensor([0.5, 1.0]),
        "complex": torch.tensor([1 + 1j, 2 + 1j]),
        "bf16": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    }
    rows = {t.name: t for t in diff(a, b).tensors}
    assert rows["big"].bit_equal and rows["big"].inf_a == 0 and rows["big"].allclose
    assert (rows["ints"].max_abs, rows["ints"].mismatched) == (2.0, 1)
    assert rows["ints"].max_rel == pytest.approx(0.4)
    assert rows["flags"].status == "differ" and rows["flags"].max_rel == 1.0
    assert rows["half_vs_float"].status == "dtype" and rows["half_vs_float"].max_abs == 0
    assert rows["complex"].max_abs == pytest.approx(2.0) and not rows["complex"].allclose
    assert rows["bf16"].status == "equal"


#: Integers past float64's exact range (2**53), and both ends of int64 and uint64.
_INTEGERS = {
    "int64": (
        [2**53 + 1, 2**62, -(2**63), 2**63 - 1, -5, 7, 3],
        [2**53, 2**62, 2**63 - 1, 2**63 - 2, -5, 6, 3],
    ),
    "uint64": (
        [2**53 + 1, 2**63, 2**64 - 1, 2**64 - 2, 5, 7, 3],
        [2**53, 2**63, 2**64 - 2, 2**64 - 2, 4, 7, 3],
    ),
    "int32": ([2**31 - 1, -(2**31), 0, 1, -5, 7, 4], [2**31 - 1, -(2**31), 0, 1, -5, 7, 4]),
    "uint8": ([255, 0, 1, 2, 3, 7, 4], [255, 0, 1, 2, 3, 7, 4]),
}


@pytest.mark.parametrize(
    ("dtype_a", "dtype_b"),
    [("int64", "int64"), ("int64", "int32"), ("uint64", "uint64"), ("int64", "uint8")],
)
def test_integers_past_float64s_precision_compare_exactly(dtype_a: str, dtype_b: str) -> None:
    # float64 holds integers exactly up to 2**53: past it, two that differ by 1 are equal there.
    a_values = _INTEGERS[dtype_a][0]
    b_values = _INTEGERS[dtype_b][1 if dtype_a == dtype_b else 0]
    a = {"i": torch.tensor(a_values, dtype=getattr(torch, dtype_a))}
    b = {"i": torch.tensor(b_values, dtype=getattr(torch, dtype_b))}
    exact = [abs(x - y) for x, y in zip(a_values, b_values)]
    for atol in (0.0, 1.0):
        row = diff(a, b, rtol=0.0, atol=atol).tensors[0]
        assert row.mismatched == sum(d > atol for d in exact), atol
        assert row.max_abs == float(max(exact)) and row.allclose == (max(exact) <= atol)
        if torch.uint64 not in (a["i"].dtype, b["i"].dtype):
            close = torch.isclose(a["i"], b["i"].to(torch.int64), rtol=0, atol=atol)
            assert row.mismatched == int((~close).sum())


def test_keys_shapes_and_dtypes(save: Callable[..., str]) -> None:
    a = layers()
    b = layers()
    b["layers.0.weight"] = b["layers.0.weight"].double()
    b["head.weight"] = torch.zeros(4, 6)
    a["only_a"] = torch.zeros(1)
    b["only_b.0"] = torch.zeros(1)
    report = diff(save(a, "a.pt"), save(b, "b.safetensors"))
    assert report.missing == ("only_b.0",)
    assert report.unexpected == ("only_a",)
    assert [t.name for t in report.shape_mismatches] == ["head.weight"]
    (dtype,) = report.dtype_mismatches
    assert dtype.name == "layers.0.weight" and dtype.status == "dtype" and dtype.allclose
    assert report.found() == frozenset({"missing", "unexpected", "shape", "dtype"})
    assert report.b.format == "safetensors" and report.a.format == "torch-zip"


def test_module_and_state_dict_sides(save: Callable[..., str]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    path = save({"epoch": 1, "state_dict": model.state_dict()}, "trainer.pt")
    report = diff(path, model)
    assert report.identical
    assert report.a.selected == ("state_dict",) and report.b.kind == "module"
    assert diff(model.state_dict(), {"nested": model.state_dict()}).identical
    with pytest.raises(UsageError, match="not to a module"):
        diff(path, model, select_b="x")


# --- streaming reads --------------------------------------------------------------------


def test_views_and_strides_are_read_from_their_storage(save: Callable[..., str]) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    sd = {
        "base": base,
        "transposed": base.t(),
        "rows": base[2:4],
        "strided": base[1::2, 3::3],
        "scalar": base[5, 9],
        "empty": base[:0],
        "half": torch.randn(7).half(),
        "flags": torch.tensor([True, False, True]),
    }
    path = save(sd, "views.pt")
    ckpt = open_checkpoint(path)
    for name, expected in sd.items():
        got = read_tensor(ckpt, ckpt.root[name])
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
        chunks = list(iter_chunks(ckpt, ckpt.root[name], chunk_bytes=8))
        assert torch.equal(torch.cat(chunks) if chunks else torch.empty(0), expected.reshape(-1))
    assert diff(path, sd, chunk_bytes=16).identical


def test_legacy_and_sharded_files_stream_too(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"base": base, "t": base.t(), "tail": base[2:], "bias": torch.randn(3)}
    legacy = tmp_path / "legacy.pt"
    torch.save(sd, legacy, _use_new_zipfile_serialization=False)
    assert diff(legacy, sd).identical
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file({"base": base}, folder / "part-1.safetensors")
    save_file({"bias": sd["bias"]}, folder / "part-2.safetensors")
    index = {"weight_map": {"base": "part-1.safetensors", "bias": "part-2.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    report = diff(folder, legacy)
    assert report.a.format == "hf-sharded" and report.missing == ("t", "tail")
    assert all(t.bit_equal for t in report.tensors) and len(report.tensors) == 2


def test_small_chunks_give_the_same_answer(save: Callable[..., str]) -> None:
    a, b = layers(seed=0), layers(seed=0)
    b["layers.3.weight"][2, 2] += 0.5
    b["head.weight"][0, 0] = math.nan
    big = diff(save(a, "a.pt"), save(b, "b.pt"))
    small = diff(save(a, "a.pt"), save(b, "b.pt"), chunk_bytes=12)
    assert big.to_json() == small.to_json()
    assert [t.name for t in big.value_mismatches] == ["layers.3.weight", "head.weight"]


# --- suggestions ------------------------------------------------------------------------

PREFIXES = [
    "module.",
    "_orig_mod.",
    "model.",
    "_forward_module.",
    "_fsdp_wrapped_module.",
    "base_model.model.",
]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_suggests_stripping_each_wrapper(prefix: str, save: Callable[..., str]) -> None:
    plain = layers()
    a = save({prefix + k: v for k, v in plain.items()}, "wrapped.pt")
    b = save(plain, "plain.pt")
    best = diff(a, b).suggestions[0]
    assert str(best) == best.text()
    assert best.description == f"stripping {prefix!r}"
    assert (best.resolved, best.of) == (9, 9)
    assert best.text().startswith(f"stripping {prefix!r} resolves 9 of 9 unexpected keys: ckpt ")
    # The printed commands are real: running them removes the mismatch.
    run(best.command)
    assert diff(a.replace(".pt", ".renamed.pt"), b).identical
    run(best.inverse_command)
    assert diff(a, b.replace(".pt", ".renamed.pt")).identical


@pytest.mark.parametrize("prefix", PREFIXES)
def test_suggests_adding_each_wrapper(prefix: str, save: Callable[..., str]) -> None:
    plain = layers()
    a = save(plain, "plain.pt")
    b = save({prefix + k: v for k, v in plain.items()}, "wrapped.pt")
    best = diff(a, b).suggestions[0]
    assert best.description == f"adding {prefix!r}"
    run(best.command)
    assert diff(a.replace(".pt", ".renamed.pt"), b).identical


def test_stacked_wrappers_and_exact_strip_module_command(save: Callable[..., str]) -> None:
    plain = layers()
    a = save({"module._orig_mod." + k: v for k, v in plain.items()}, "in.pt")
    b = save(plain, "plain.pt")
    best = diff(a, b).suggestions[0]
    assert best.description == "stripping 'module.', then stripping '_orig_mod.'"
    assert best.command == f"ckpt strip-module {shlex.quote(a)} {shlex.quote(a[:-3])}.renamed.pt"
    ddp = save({"module." + k: v for k, v in plain.items()}, "ddp.pt")
    assert diff(ddp, b).suggestions[0].command.startswith("ckpt strip-module ")


def test_prefix_map_suggestion_and_module_note(save: Callable[..., str]) -> None:
    plain = layers()
    a = save({k.replace("layers.", "backbone.", 1): v for k, v in plain.items()}, "a.pt")
    best = diff(a, plain).suggestions[0]
    assert best.description == "renaming 'backbone.' to 'layers.'"
    assert "--sub backbone.=layers." in best.command
    assert best.inverse_command.startswith("ckpt_tools.rename_keys(sd_b")

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    model = Holder()
    wrapped = save({"module." + k: v for k, v in model.state_dict().items()}, "m.pt")
    best = diff(wrapped, model).suggestions[0]
    assert "load_into" in best.note and best.inverse_command == ""
    aligned = diff(wrapped, model, align=True)
    assert aligned.identical and aligned.aligned == ("stripping 'module.'",)


def test_a_rewrite_resolving_every_key_drops_the_partial_ones(save: Callable[..., str]) -> None:
    model = nn.Sequential()
    model.add_module("conv", nn.Conv2d(3, 4, 3))
    model.add_module("bn", nn.BatchNorm2d(4))
    model.add_module("fc", nn.Linear(4, 2))
    a = save({"module." + k: v for k, v in model.state_dict().items()}, "ddp.pt")
    b = save(model.state_dict(), "plain.pt")
    report = diff(a, b)
    assert [(s.description, s.resolved, s.of) for s in report.suggestions] == [
        ("stripping 'module.'", 9, 9)
    ]
    assert "resolves 5 of 9" not in report.text()
    # Without a rewrite that resolves all, the partial ones are still suggested.
    partial = {"module.bn." + k: v for k, v in model.bn.state_dict().items()}
    partial["head.weight"] = torch.zeros(1)
    texts = [s.text() for s in diff(partial, model.state_dict()).suggestions]
    assert texts and texts[0].startswith("stripping 'module.' resolves 5 of 6")


def test_package_functions_survive_importing_their_modules() -> None:
    # A submodule named like a function would replace it on import; ours are named apart.
    import ckpt_tools.diffing.engine
    import ckpt_tools.loading.into_module
    import ckpt_tools.ops.rewrite.rewriting

    assert ckpt_tools.diff({"w": torch.ones(1)}, {"w": torch.ones(1)}).identical
    assert ckpt_tools.diff is ckpt_tools.diffing.engine.diff
    assert ckpt_tools.rewrite is ckpt_tools.ops.rewrite.rewriting.rewrite
    assert ckpt_tools.load_into is ckpt_tools.loading.into_module.load_into
    assert ckpt_tools.DiffReport is ckpt_tools.diffing.engine.DiffReport


def run(command: str) -> None:
    args = shlex.split(command)
    assert args[0] == "ckpt"
    run_ckpt(*args[1:], "-q")


def test_suggestions_never_rename_onto_a_tensor_of_another_shape(tmp_path) -> None:
    # module.0.weight is [3, 4] and 2.weight is [2, 3]: renaming one onto the other would
    # "match" the key and then fail to load, so it must not be offered.
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    path = tmp_path / "ddp.pt"
    torch.save(data_parallel(model).state_dict(), path)
    texts = [str(s) for s in diff(path, model).suggestions]
    assert texts and "stripping 'module.' resolves 4 of 4" in texts[0]
    assert not any("'module.0.' to '2.'" in t or "'module.2.' to '0.'" in t for t in texts)


def test_a_root_that_is_no_mapping_is_refused_not_compared_as_empty(
    save: Callable[..., str],
) -> None:
    # torch.save(tensor) and torch.save([...]) hold no state dict: each would compare as an
    # empty one, "identical" to the other.
    tensor, listed = save(torch.arange(3.0), "t.pt"), save([torch.ones(1)], "l.pt")
    with pytest.raises(UsageError, match=r"'.*t\.pt' holds a tensor, not a state dict"):
        diff(tensor, listed)
    _, _, err = run_ckpt("diff", save({"w": torch.ones(1)}, "d.pt"), listed, code=2)
    assert err.endswith(
        "l.pt' holds a list, not a state dict (a mapping of names to tensors); "
        "diff compares state dicts\n"
    )


class _Config(dict):
    """A dict subclass of the training script's own, which the reader never imports."""


def test_a_state_dict_in_an_object_of_its_own_class_is_refused_not_compared_as_the_root(
    save: Callable[..., str],
) -> None:
    # The tensors lie in the object, which is never built: comparing the root would report
    # 0 tensors and every key of B missing, with exit 0.
    wrapped = save({"state_dict": _Config(w=torch.ones(2)), "epoch": 1}, "wrapped.pt")
    plain = save({"w": torch.ones(2)}, "plain.pt")
    with pytest.raises(UsageError, match=r"'state_dict' \(.*_Config\)") as info:
        diff(wrapped, plain)
    assert "diff compares state dicts" in str(info.value)
    _, _, err = run_ckpt("diff", plain, wrapped, code=2)
    assert f"ckpt sanitize {wrapped} OUT.pt" in err
    # The remedy works: the sanitized file holds the tensors as a plain dict.
    out = str(Path(wrapped).with_name("clean.pt"))
    run_ckpt("sanitize", wrapped, out)
    assert diff(out, plain).identical
    # Beside a tensor of the root's own (a best accuracy), the object is still the candidate.
    own = {"net": _Config(w=torch.ones(2)), "best_acc": torch.tensor(0.9), "epoch": 5}
    scalar = save(own, "acc.pt")
    with pytest.raises(UsageError, match=r"'net' \(.*_Config\)"):
        diff(scalar, plain)
    # An object that holds no tensors (a config) is no state dict: the root is compared.
    beside = save({"w": torch.ones(2), "config": _Config(lr=0.1)}, "beside.pt")
    report = diff(beside, plain)
    assert report.a.tensors == 1 and report.values_compared == 1
    hyper = save({"epoch": 1, "hyper_parameters": _Config(lr=0.1)}, "hyper.pt")
    assert diff(hyper, hyper).a.tensors == 0


@pytest.mark.parametrize("order", ["int-first", "str-first"])
def test_keys_with_one_name_are_refused_not_merged(tmp_path: Path, order: str) -> None:
    # torch.load gives two entries, 0 and "0"; compared by name, one would hide the other.
    entries = [(0, torch.tensor(False)), ("0", torch.tensor(True))]
    entries = entries if order == "int-first" else entries[::-1]
    torch.save(dict(entries), tmp_path / "a.pt")
    torch.save({0: torch.tensor(True), "0": torch.tensor(True)}, tmp_path / "b.pt")
    assert len(torch.load(tmp_path / "a.pt", weights_only=True)) == 2
    with pytest.raises(KeyCollisionError, match="both named '0'"):
        diff(tmp_path / "a.pt", tmp_path / "b.pt")
    run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--fail-on", "any", code=7)


def test_a_suggested_rewrite_names_the_globals_it_must_carry(tmp_path: Path) -> None:
    # The command is run as printed: without --allow-global the rewrite refuses the file.
    import argparse

    plain = {"w": torch.ones(2), "b": torch.zeros(2)}
    wrapped = {f"module.{k}": v for k, v in plain.items()}
    torch.save({"state_dict": wrapped, "args": argparse.Namespace(lr=0.1)}, tmp_path / "a.ckpt")
    torch.save(plain, tmp_path / "b.pt")
    (suggestion,) = diff(tmp_path / "a.ckpt", tmp_path / "b.pt").suggestions
    assert suggestion.command.endswith("--allow-global argparse.Namespace")
    run_ckpt(*shlex.split(suggestion.command)[1:])
    out = torch.load(tmp_path / "a.renamed.ckpt", weights_only=False)["state_dict"]
    assert list(out) == list(plain)


@pytest.mark.parametrize("in_memory", [False, True], ids=["files", "state-dicts"])
def test_a_dim_both_sides_repeat_is_compared_once_and_counted_in_full(
    tmp_path: Path, in_memory: bool
) -> None:
    # Expanded views (stride 0), one of them with a NaN, against a materialized copy.
    row_a = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    row_b = torch.tensor([1.0, 2.5, float("nan"), 4.0])
    a = {"w": row_a.expand(3000, 4), "m": row_a.expand(5, 4)}
    b = {"w": row_b.expand(3000, 4), "m": row_b.expand(5, 4).clone()}
    if not in_memory:
        torch.save(a, tmp_path / "a.pt")
        torch.save(b, tmp_path / "b.pt")
        a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    report = diff(a, b)
    for name, rows in (("w", 3000), ("m", 5)):
        got = next(t for t in report.tensors if t.name == name)
        assert got.numel == rows * 4 and got.mismatched == rows and got.nan_a == rows, name
        assert got.max_abs == 0.5 and not got.bit_equal


def test_an_expanded_view_of_2_to_the_62_elements_is_compared_not_walked(tmp_path: Path) -> None:
    # torch saves the one stored element; walking every element would never end.
    torch.save({"w": torch.zeros(1).expand(2**31, 2**31)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(1).expand(2**31, 2**31)}, tmp_path / "b.pt")
    res = run_ckpt(
        "diff",
        tmp_path / "a.pt",
        tmp_path / "b.pt",
        "--json",
        how="module",
        timeout=120,
    )
    (w,) = json.loads(res.stdout)["tensors"]
    assert w["numel"] == w["mismatched"] == 2**62 and w["max_abs"] == 1.0


def test_an_int_key_and_its_text_in_the_other_side_are_refused_not_paired(tmp_path: Path) -> None:
    # torch.load gives [7] and ['7']: two different keys, which a diff pairs by name.
    torch.save({7: torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"7": torch.ones(2)}, tmp_path / "b.pt")
    with pytest.raises(KeyCollisionError, match="'7' is a str key in one side"):
        diff(tmp_path / "a.pt", tmp_path / "b.pt")
    with pytest.raises(KeyCollisionError):
        diff({7: torch.ones(2)}, {"7": torch.ones(2)})
    res = run_ckpt("diff", tmp_path / "a.pt", tmp_path / "b.pt", code=7)
    assert res.stderr.count("\n") == 1
    assert diff(tmp_path / "a.pt", tmp_path / "a.pt").identical
