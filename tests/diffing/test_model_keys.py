"""diff() against a module reports the keys torch's strict ``load_state_dict`` would: its
modules' loading code taken into account (old BatchNorm and ``weight_norm`` state dicts), every
key counted (``_extra_state``, ``epoch``), lazy parameters of any shape."""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_tools as ct
from ckpt_tools.diffing.engine import diff
from tests.diffing.conftest import Save
from tests.helpers import run_ckpt


class OldBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)


class NewWN(nn.Module):  # parametrizations.weight_norm: original0 / original1
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.parametrizations.weight_norm(nn.Linear(3, 4))


class OldWN(nn.Module):  # the deprecated weight_norm: weight_g / weight_v
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.utils.weight_norm(nn.Linear(3, 4))


class WithExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.cfg = {"a": 1}

    def get_extra_state(self) -> Any:
        return self.cfg

    def set_extra_state(self, state: Any) -> None:
        self.cfg = state


class BrokenExtra(WithExtra):  # its state_dict() raises: the model's own fault
    def get_extra_state(self) -> Any:
        raise RuntimeError("cfg is not ready")


class Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.LazyLinear(4)
        self.bn = nn.LazyBatchNorm1d()


class NoCopy(OldBN):
    def __deepcopy__(self, memo: Any) -> Any:
        raise TypeError("this model does not copy")


def _bn_before_version_2(version: int | None) -> OrderedDict[str, torch.Tensor]:
    sd = OldBN().state_dict()
    sd.pop("bn.num_batches_tracked")
    if version is None:
        del sd._metadata  # type: ignore[attr-defined]  # no versions: torch assumes old
    else:
        sd._metadata["bn"]["version"] = version  # type: ignore[attr-defined]
    return sd


def _old_weight_norm() -> dict[str, torch.Tensor]:
    with pytest.warns(FutureWarning):
        return OldWN().state_dict()


def _plain_for_lazy() -> dict[str, torch.Tensor]:
    sd = {"fc." + k: v for k, v in nn.Linear(3, 4).state_dict().items()}
    return {**sd, **{"bn." + k: v for k, v in nn.BatchNorm1d(4).state_dict().items()}}


def _ddp(sd: dict[str, Any]) -> OrderedDict[str, Any]:
    out = OrderedDict(("module." + k, v) for k, v in sd.items())
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict(  # type: ignore[attr-defined]
            (f"module.{k}" if k else "module", v) for k, v in metadata.items()
        )
    return out


def _no_extra() -> dict[str, Any]:
    sd = WithExtra().state_dict()
    sd.pop("_extra_state")
    return sd


def _linear() -> nn.Module:
    return nn.Linear(2, 2)


CASES: dict[str, tuple[Callable[[], Any], Callable[[], nn.Module]]] = {
    "bn version 1": (lambda: _bn_before_version_2(1), OldBN),
    "bn no versions": (lambda: _bn_before_version_2(None), OldBN),
    "bn version 2": (lambda: _bn_before_version_2(2), OldBN),  # torch: missing
    "old weight_norm": (_old_weight_norm, NewWN),
    "extra state missing": (_no_extra, WithExtra),
    "epoch beside the weights": (lambda: {**nn.Linear(2, 2).state_dict(), "epoch": 3}, _linear),
    "ddp keys": (lambda: _ddp(OldBN().state_dict()), OldBN),
    "ddp old bn": (lambda: _ddp(_bn_before_version_2(1)), OldBN),
    "lazy": (_plain_for_lazy, Lazy),
    "same": (lambda: OldBN().state_dict(), OldBN),
}


def _torch_says(model: nn.Module, sd: Any) -> tuple[set[str], set[str]]:
    """torch's own missing and unexpected keys, loading a copy (strict=False lists them)."""
    result = model.load_state_dict(copy.deepcopy(sd), strict=False)
    return set(result.missing_keys), set(result.unexpected_keys)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("as_file", [True, False], ids=["file", "state dict"])
def test_missing_and_unexpected_are_torchs(
    case: str, as_file: bool, save: Save, recwarn: Any
) -> None:
    make_sd, make_model = CASES[case]
    sd = make_sd()
    missing, unexpected = _torch_says(make_model(), sd)
    side = save(sd, "a.pt") if as_file else sd
    report = diff(side, make_model())
    assert (set(report.missing), set(report.unexpected)) == (missing, unexpected)
    assert len(report.missing) == len(missing) and len(report.unexpected) == len(unexpected)
    # What names alone would add is reconciled: neither missing nor unexpected.
    keys_a, keys_b = {str(k) for k in sd}, set(make_model().state_dict())
    assert set(report.reconciled_missing) == (keys_b - keys_a) - missing
    assert set(report.reconciled_unexpected) == (keys_a - keys_b) - unexpected
    assert not report.keys_by_name
    if not (missing or unexpected or report.reconciled_missing or report.reconciled_unexpected):
        assert {"missing", "unexpected"}.isdisjoint(report.found())


@pytest.mark.parametrize("case", ["bn version 1", "old weight_norm", "ddp old bn", "ddp keys"])
def test_align_agrees_with_load_into(case: str, save: Save, recwarn: Any) -> None:
    make_sd, make_model = CASES[case]
    path = save(make_sd(), "a.pt")
    loaded = ct.load_into(make_model(), path, strict=False)
    report = diff(path, make_model(), align=True)
    assert report.missing == loaded.missing == () and report.unexpected == loaded.unexpected == ()
    assert report.aligned == loaded.rewrites
    assert "missing" not in report.found() and "unexpected" not in report.found()
    if report.reconciled_missing or report.reconciled_unexpected:
        assert not report.identical  # keys reconciled are not the same keys


def test_old_batchnorm_is_reconciled_and_its_tensors_compared(save: Save) -> None:
    torch.manual_seed(0)
    model = OldBN()
    sd = model.state_dict()
    sd.pop("bn.num_batches_tracked")
    sd._metadata["bn"]["version"] = 1  # type: ignore[attr-defined]
    report = diff(save(sd, "old.pt"), model)
    assert report.missing == report.unexpected == ()
    assert report.reconciled_missing == ("bn.num_batches_tracked",)
    assert {t.name: t.status for t in report.tensors} == dict.fromkeys(sd, "equal")
    text = report.text()
    assert "reconciled by B's loading code, not compared (in B, not in A): 1" in text
    assert "identical" not in text and "missing (in B" not in text
    data = report.to_json()
    assert data["reconciled_missing"] == ["bn.num_batches_tracked"]
    assert data["reconciled_unexpected"] == [] and data["keys_by_name"] == ""


def test_a_missing_extra_state_is_missing(save: Save) -> None:
    report = diff(save(_no_extra(), "a.pt"), WithExtra(), values=False)
    assert report.missing == ("_extra_state",) and "missing" in report.found()
    assert "same keys" not in report.text()
    with pytest.raises(ct.StateDictMismatchError):  # as load_into refuses it
        ct.load_into(WithExtra(), save(_no_extra(), "b.pt"))


def test_keys_on_one_side_only_count_between_files_too(save: Save) -> None:
    w = torch.ones(2)
    a, b = save({"w": w, "epoch": 3}, "a.pt"), save({"w": w}, "b.pt")
    report = diff(a, b)
    assert report.unexpected == ("epoch",) and not report.identical
    assert report.a.skipped == ("epoch",)  # counted as a key, its value not compared
    assert diff(b, a).missing == ("epoch",)
    both = diff(a, save({"w": w, "epoch": 4}, "c.pt"))
    assert both.identical and both.unexpected == () and "epoch" not in both
    # An alignment renames every key, not the tensors' alone.
    wrapped = save({"module.w": w, "module.epoch": 3}, "ddp.pt")
    aligned = diff(wrapped, a, align=True)
    assert aligned.identical and aligned.aligned == ("stripping 'module.'",)


def test_a_suggestion_counts_every_unexpected_key(save: Save) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))
    sd = {"module." + k: v for k, v in net.state_dict().items()}
    report = diff(save({**sd, "epoch": 3}, "ddp.pt"), net)
    assert len(report.unexpected) == 5
    best = report.suggestions[0]
    assert best.description == "stripping 'module.'" and (best.resolved, best.of) == (4, 5)
    assert all(s.resolved < s.of == 5 for s in report.suggestions)
    # A model's _extra_state under the same wrapper is resolved with the tensors.
    extra = {"module." + k: v for k, v in WithExtra().state_dict().items()}
    (only,) = diff(extra, WithExtra()).suggestions
    assert (only.description, only.resolved, only.of) == ("stripping 'module.'", 3, 3)


def test_a_suggestion_counts_what_torch_would_take(save: Save, recwarn: Any) -> None:
    # Stripping 'module.' leaves weight_g/weight_v, which the model's hook takes.
    report = diff(save(_ddp(_old_weight_norm()), "ddp.pt"), NewWN())
    assert len(report.unexpected) == 3
    best = report.suggestions[0]
    assert best.description == "stripping 'module.'" and (best.resolved, best.of) == (3, 3)
    assert "load_into" in best.note


def test_a_suggestion_names_what_stays_missing_once_applied(save: Save) -> None:
    # As stored, 'module.bn' is version 2 and 'bn' has no version: torch fills the missing
    # num_batches_tracked of the keys as they are. Stripped, the version moves to 'bn' and
    # torch calls it missing: the suggestion says so.
    sd = _ddp(_bn_before_version_2(2))
    path = save(sd, "ddp.pt")
    report = diff(path, OldBN())
    (best,) = report.suggestions
    stripped = OrderedDict((k[len("module.") :], v) for k, v in sd.items())
    stripped._metadata = OrderedDict(  # type: ignore[attr-defined]  # as strip-module moves it
        (k[len("module.") :] if k != "module" else "", v) for k, v in sd._metadata.items()
    )
    missing, unexpected = _torch_says(OldBN(), stripped)
    assert (missing, unexpected) == ({"bn.num_batches_tracked"}, set())
    assert best.missing == ("bn.num_batches_tracked",)
    assert "leaves 1 missing (bn.num_batches_tracked)" in best.text()
    # Between state dicts, the keys of B the renamed A lacks.
    (by_name,) = diff(path, OldBN().state_dict()).suggestions
    assert by_name.missing == ("bn.num_batches_tracked",)


def test_a_one_element_vector_loads_into_a_0_dim_parameter(save: Save) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.0))

    path = save({"scale": torch.tensor([2.5])}, "old.pt")
    model = Scaled()
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)  # torch takes it
    (pair,) = diff(path, Scaled()).tensors
    assert (pair.status, pair.squeezed, pair.max_abs) == ("differ", True, 1.5)
    assert diff(path, model).found() == set() and not diff(path, model).shape_mismatches
    # A longer vector, or one between two state dicts, is a shape difference.
    assert diff(save({"scale": torch.ones(2)}, "two.pt"), Scaled()).tensors[0].status == "shape"
    assert diff(path, Scaled().state_dict()).tensors[0].status == "shape"


def test_a_model_that_does_not_copy_is_compared_by_name(
    save: Save, caplog: pytest.LogCaptureFixture
) -> None:
    report = diff(save(_bn_before_version_2(1), "old.pt"), NoCopy())
    assert report.missing == ("bn.num_batches_tracked",)
    assert "does not copy" in report.keys_by_name
    assert "keys compared by name, not as torch loads them" in report.text()


# --- lazy modules -----------------------------------------------------------------------


def test_an_uninitialized_parameter_takes_any_shape(save: Save) -> None:
    path = save(_plain_for_lazy(), "plain.pt")
    report = diff(path, Lazy())
    assert report.missing == report.unexpected == () and report.found() == frozenset()
    lazy = [t for t in report.tensors if t.status == "uninitialized"]
    assert {t.name for t in lazy} == {
        "fc.weight",
        "fc.bias",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
    }
    weight = report.tensor("fc.weight")
    assert weight.shape_a == (4, 3) and weight.shape_b is None and weight.bit_equal is None
    assert report.tensor("bn.num_batches_tracked").status == "equal"
    assert not report.identical and not report.shape_mismatches
    assert "[4, 3] / uninitialized" in report.text()
    (row,) = [t for t in report.to_json()["tensors"] if t["name"] == "fc.weight"]
    assert row["uninitialized"] == [False, True] and row["shape"] == [[4, 3], []]
    # Either side, with or without values; torch loads the same file.
    assert diff(Lazy(), path, values=False).tensor("fc.weight").status == "uninitialized"
    assert Lazy().load_state_dict(torch.load(path)) is not None


def test_a_lazy_parameter_renamed_onto_is_a_match_for_suggestions(save: Save) -> None:
    path = save({"module." + k: v for k, v in _plain_for_lazy().items()}, "ddp.pt")
    best = diff(path, Lazy()).suggestions[0]
    assert best.description == "stripping 'module.'" and best.resolved == best.of == 7


# --- the command ------------------------------------------------------------------------

MODELS_PY = """
from torch import nn
from tests.diffing.test_model_keys import BrokenExtra, Lazy, NewWN, OldBN, WithExtra
"""


@pytest.fixture
def models(tmp_path: Path) -> str:
    (tmp_path / "models.py").write_text(MODELS_PY)
    return str(tmp_path / "models.py")


def test_the_command_fails_on_what_torch_refuses_only(
    models: str, save: Save, recwarn: Any
) -> None:
    old_bn = save(_bn_before_version_2(1), "old_bn.pt")
    old_wn = save(_old_weight_norm(), "old_wn.pt")
    for path, model, extra in (
        (old_bn, "OldBN", ()),
        (old_wn, "NewWN", ()),
        (old_wn, "NewWN", ("--align",)),
    ):
        args = ("diff", path, "--model", f"{models}:{model}", *extra)
        code, out, _ = run_ckpt(*args, "--fail-on", "missing,unexpected", code=None)
        assert code == 0 and "reconciled by B's loading code" in out, out
    no_extra = save(_no_extra(), "no_extra.pt")
    args = ("diff", no_extra, "--model", f"{models}:WithExtra", "--no-values", "--fail-on", "any")
    code, out, _ = run_ckpt(*args, code=None)
    assert code == 1 and "missing (in B, not in A): 1\n  _extra_state" in out
    assert "same keys" not in out and "failing on: missing" in out
    code, out, _ = run_ckpt(*args, "--json", code=None)
    assert code == 1 and json.loads(out)["missing"] == ["_extra_state"]


def test_the_command_on_a_lazy_model(models: str, save: Save) -> None:
    path = save(_plain_for_lazy(), "plain.pt")
    code, out, err = run_ckpt("diff", path, "--model", f"{models}:Lazy", "--fail-on", "any")
    assert code == 0 and "Traceback" not in out + err
    assert "fc.weight" in out and "uninitialized" in out


def test_a_model_whose_state_dict_raises_is_named_in_one_line(models: str, save: Save) -> None:
    path = save(_no_extra(), "no_extra.pt")
    code, out, err = run_ckpt("diff", path, "--model", f"{models}:BrokenExtra", code=None)
    assert code == 2 and "Traceback" not in out + err, err
    assert "BrokenExtra.state_dict() failed: RuntimeError: cfg is not ready" in err
    with pytest.raises(ct.UsageError, match=r"BrokenExtra.state_dict\(\) failed") as caught:
        diff(path, BrokenExtra())
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_an_adapters_own_prefix_is_no_wrapper_in_the_header(tmp_path: Path) -> None:
    # PEFT loads an adapter's keys as they are: inspect and strip-module find no wrapper.
    from tests.helpers.lora import write_tiny_adapter

    adapter = write_tiny_adapter(tmp_path / "adapter") / "adapter_model.safetensors"
    report = diff(adapter, adapter)
    assert report.a.wrappers == () and report.b.wrappers == ()
    assert ct.inspect(adapter).wrappers == ()
    plain = {k.removeprefix("base_model.model."): v for k, v in ct.load_state_dict(adapter).items()}
    wrapped = {f"module.{k}": v for k, v in plain.items()}  # a plain file's keys: still found
    assert diff(plain, wrapped, align=True).b.wrappers == ("module.",)
