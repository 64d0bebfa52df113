"""``ckpt sanitize`` writes a file plain ``torch.load(weights_only=True)`` loads.

The inputs are built like the real cases: a Lightning-style checkpoint whose hparams are
OmegaConf-like configs from a module that is gone when the file is read, numpy arrays and
scalars in a trainer config, a pickled model of an unimportable class, and a payload whose
``__reduce__`` would create a marker file. The oracles are ``torch.load(weights_only=True)``
on the output and the original objects, kept in memory, compared bit for bit.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import io
import json
import os
import pathlib
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckpt_tools as ct
from ckpt_tools.cli.main import cli
from ckpt_tools.formats.pickle.unpickler import load_pickle
from ckpt_tools.ops.sanitize.tree import sanitize_tree
from tests import helpers as h

CKPT = str(Path(sys.executable).with_name("ckpt"))

# How omegaconf 2.x pickles a config: a container's __dict__ (its __getstate__ drops only
# the flags cache) holds ``_metadata``, ``_parent`` and ``_content``, a dict (DictConfig) or a
# list (ListConfig) of nodes; a value node's __dict__ holds ``_val``.
FAKE_OMEGACONF = """
import enum
import os
import torch
from torch import nn


class Metadata:
    def __init__(self, key=None):
        self.ref_type = object
        self.object_type = dict
        self.optional = True
        self.key = key
        self.flags = {}


class Node:
    def __init__(self, parent, key):
        self._metadata = Metadata(key)
        self._parent = parent


class AnyNode(Node):
    def __init__(self, value, parent=None, key=None):
        super().__init__(parent, key)
        self._val = value


class DictConfig(Node):
    def __init__(self, content, parent=None, key=None):
        super().__init__(parent, key)
        self._flags_cache = {}
        self._content = {k: wrap(v, self, k) for k, v in content.items()}

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_flags_cache", None)
        return state


class ListConfig(DictConfig):
    def __init__(self, content, parent=None, key=None):
        Node.__init__(self, parent, key)
        self._content = [wrap(v, self, i) for i, v in enumerate(content)]


def wrap(value, parent, key):
    if isinstance(value, dict):
        return DictConfig(value, parent, key)
    if isinstance(value, list):
        return ListConfig(value, parent, key)
    return AnyNode(value, parent, key)


class Mode(enum.Enum):
    TRAIN = "train"

    # By value, as Python 3.11.5 and later pickle a member (3.11.0 to 3.11.4: by name), so
    # that the file under test is the same on every Python.
    def __reduce_ex__(self, protocol):
        return type(self), (self._value_,)


class Stage(enum.Enum):
    FIT = "fit"

    # By name, as Python 3.11.0 to 3.11.4 pickle a member: a call of builtins.getattr.
    def __reduce_ex__(self, protocol):
        return getattr, (type(self), self._name_)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.register_buffer("cache", torch.zeros(1), persistent=False)
"""

CFG = {
    "model": {"width": 64, "act": "gelu", "dims": [1, 2, {"deep": None}]},
    "lr": 0.001,
    "missing": "???",
    "ref": "${model.width}",
}


def _nan_payload() -> np.ndarray:
    return np.array([0x7FC00001, 0x80000000, 0x3F800000], dtype=np.uint32).view(np.float32)


CONFIG_ARRAYS = {
    "mean": np.array([0.485, 0.456, 0.406], dtype=np.float32),
    "nan_payload": _nan_payload(),
    "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
    "fortran": np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4) / 7),
    "big_fortran": np.asfortranarray(np.arange(6, dtype=">f2").reshape(2, 3)),
    "complex": np.array([1 + 2j, -0.0 - 3j], dtype=np.complex64),
    "mask": np.array([True, False, True]),
    "u16": np.array([1, 65535], dtype=np.uint16),
    "empty": np.zeros((0, 3), dtype=np.int64),
    "zero_d": np.array(3.5, dtype=np.float16),
}
CONFIG_SCALARS = {
    "scale": np.float32(0.1),
    "steps": np.int64(-7),
    "flag": np.bool_(True),
    "big": np.dtype(">f8").type(2.5),
    "z": np.complex128(1 - 1j),
}


@pytest.fixture
def fake(tmp_path: Path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "fakeomega_i10.py").write_text(FAKE_OMEGACONF)
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module("fakeomega_i10")
    finally:
        sys.path.remove(str(folder))
    yield module
    sys.modules.pop("fakeomega_i10", None)


def _forget(tmp_path: Path) -> None:
    sys.modules.pop("fakeomega_i10", None)
    (tmp_path / "src" / "fakeomega_i10.py").unlink()
    assert importlib.util.find_spec("fakeomega_i10") is None


def _lightning(fake: Any, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A Lightning-style checkpoint; returns it and the original objects to compare with."""
    torch.manual_seed(0)
    net = fake.Net()
    net.bn.running_var.uniform_()
    model = fake.Net()
    sd = {f"model.{k}": v for k, v in net.state_dict().items()}
    original = {
        "state_dict": sd,
        "model_sd": model.state_dict(),
        "marker": tmp_path / "PAYLOAD_RAN",
    }
    ckpt = {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": sd,
        "hyper_parameters": {
            "cfg": fake.DictConfig(CFG),
            "args": argparse.Namespace(lr=0.1, name="run", layers=[1, 2]),
            "mode": fake.Mode.TRAIN,
        },
        "config": {**CONFIG_ARRAYS, **CONFIG_SCALARS},
        "paths": {
            "root": pathlib.PurePosixPath("/data/run1"),
            "win": pathlib.PureWindowsPath("C:\\runs\\a"),
            "here": pathlib.Path("relative/dir"),
        },
        "counts": collections.defaultdict(int, {"a": 1, "b": 2}),
        "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
        "pickled_model": model,
        "callbacks": {"payload": fake.Payload(original["marker"]), "kept": 1},
        "list_with_payload": [1, fake.Payload(original["marker"]), 3],
    }
    path = tmp_path / "last.ckpt"
    torch.save(ckpt, path)
    _forget(tmp_path)
    return path, original


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _native(arr: np.ndarray) -> np.ndarray:
    return arr.astype(arr.dtype.newbyteorder("="))


def test_lightning_style_checkpoint_loads_with_weights_only(fake, tmp_path):
    src, original = _lightning(fake, tmp_path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(src, weights_only=True)  # what users hit today
    dst = tmp_path / "plain.ckpt"
    report = ct.sanitize(src, dst, verify="full")
    assert not original["marker"].exists()  # the payload never ran
    out = torch.load(dst, weights_only=True)
    assert not original["marker"].exists()

    # Weights: bit for bit, same dtypes, shapes and order.
    assert list(out["state_dict"]) == list(original["state_dict"])
    for name, want in original["state_dict"].items():
        got = out["state_dict"][name]
        assert (got.dtype, got.shape, _raw(got)) == (want.dtype, want.shape, _raw(want)), name
    assert report.selected == ("state_dict",) and report.tensors == len(original["state_dict"])
    # The pickled model: its state dict.
    assert list(out["pickled_model"]) == list(original["model_sd"])
    for name, want in original["model_sd"].items():
        assert _raw(out["pickled_model"][name]) == _raw(want)

    hp = out["hyper_parameters"]
    assert hp["cfg"] == CFG and type(hp["cfg"]) is dict
    assert hp["args"] == {"lr": 0.1, "name": "run", "layers": [1, 2]}
    assert hp["mode"] == "train"

    for name, arr in CONFIG_ARRAYS.items():
        got = out["config"][name]
        want = torch.from_numpy(_native(arr).copy(order="C"))
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert _raw(got) == _raw(want), name
    assert out["config"]["fortran"].stride() == (1, 3)  # Fortran order kept as strides
    for name, scalar in CONFIG_SCALARS.items():
        got = out["config"][name]
        assert type(got) is type(scalar.item()) and got == scalar.item(), name
    assert np.float32(out["config"]["scale"]).tobytes() == CONFIG_SCALARS["scale"].tobytes()

    assert out["paths"] == {"root": "/data/run1", "win": "C:\\runs\\a", "here": "relative/dir"}
    assert out["counts"] == {"a": 1, "b": 2} and type(out["counts"]) is dict
    assert list(out["ordered"]) == ["z", "a"] and isinstance(out["ordered"], dict)
    assert out["callbacks"] == {"kept": 1}
    assert out["list_with_payload"] == [1, None, 3]
    assert (out["epoch"], out["global_step"]) == (3, 120)

    dropped = {c.path: c.was for c in report.dropped_values}
    assert report.dropped == tuple(dropped)
    assert dropped == {
        "callbacks.payload": "posix.system object",
        "list_with_payload.1": "posix.system object",
    }
    converted = {c.path for c in report.converted}
    assert {"hyper_parameters.cfg", "hyper_parameters.args", "hyper_parameters.mode"} <= converted
    assert {f"config.{k}" for k in (*CONFIG_ARRAYS, *CONFIG_SCALARS)} <= converted
    assert {"paths.root", "paths.win", "paths.here", "counts", "pickled_model"} <= converted
    added = sum(a.nbytes for a in CONFIG_ARRAYS.values())
    assert report.bytes_written - report.bytes_copied == added
    assert ct.inspect(dst).unsafe_globals == ()
    assert not original["marker"].exists()


def test_strict_refuses_and_writes_nothing(fake, tmp_path):
    src, original = _lightning(fake, tmp_path)
    dst = tmp_path / "out.pt"
    with pytest.raises(ct.UnsafeContentError, match=r"2 value\(s\).*callbacks\.payload") as e:
        ct.sanitize(src, dst, refuse_unsafe=True)
    assert e.value.globals == ("posix.system",)
    said = str(e.value)
    assert "pass refuse_unsafe=False to drop them" in said and "--strict" not in said
    result = h.run_ckpt("sanitize", src, dst, "--strict", code=3)
    assert "cannot be made plain" in result.stderr and "leave out --strict" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "src"]
    assert not original["marker"].exists()


def test_a_safetensors_name_is_refused_before_the_input_is_read(tmp_path):
    # sanitize writes a torch file: under a .safetensors name neither torch.load (by path)
    # nor safetensors would read it.
    src = tmp_path / "missing.pt"  # never opened: the name is refused first
    named = r"sanitize writes a torch file: .* name it '.*out\.pt'"
    with pytest.raises(ct.UsageError, match=named):
        ct.sanitize(src, tmp_path / "out.safetensors")
    result = h.run_ckpt("sanitize", src, tmp_path / "out.safetensors", code=2)
    assert "is named as a safetensors file" in result.stderr
    assert os.listdir(tmp_path) == []


def test_an_enum_pickled_by_name_is_dropped_or_refused(fake, tmp_path):
    # Python 3.11.0 to 3.11.4 pickle an enum member as getattr(its class, its name): a call
    # of a builtin function, which sanitize neither runs nor reads as an enum member.
    src = tmp_path / "by_name.ckpt"
    hparams = {"stage": fake.Stage.FIT, "lr": 0.1}
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hparams}, src)
    _forget(tmp_path)
    report = ct.sanitize(src, tmp_path / "plain.ckpt")
    out = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert out["hyper_parameters"] == {"lr": 0.1}
    assert [str(c) for c in report.dropped_values] == [
        "hyper_parameters.stage: __builtin__.getattr object -> dropped"
    ]
    assert report.dropped == ("hyper_parameters.stage",) and report.converted == ()
    refused = tmp_path / "strict.ckpt"
    said = r"1 value\(s\).*hyper_parameters\.stage: __builtin__\.getattr object -> dropped"
    with pytest.raises(ct.UnsafeContentError, match=said) as e:
        ct.sanitize(src, refused, refuse_unsafe=True)
    assert e.value.globals == ("__builtin__.getattr",) and not refused.exists()


class _Spawns:
    """Pickles as ``subprocess.Popen(command)``: a capitalised class called with one string,
    as an enum member is; loading it would run the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (subprocess.Popen, (self.command,))


def test_a_dangerous_class_called_like_an_enum_is_dropped_never_its_value(tmp_path):
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Spawns(f"touch {tmp_path}/marker")}, src)
    report = ct.sanitize(src, tmp_path / "plain.pt")
    assert torch.load(tmp_path / "plain.pt", weights_only=True).keys() == {"w"}
    assert report.dropped == ("x",) and report.converted == ()
    with pytest.raises(ct.UnsafeContentError, match=r"x: .*Popen object -> dropped"):
        ct.sanitize(src, tmp_path / "strict.pt", refuse_unsafe=True)
    assert not (tmp_path / "strict.pt").exists() and not (tmp_path / "marker").exists()


def test_a_lazy_modules_uninitialized_parameters_are_dropped_never_a_bool(tmp_path):
    # UninitializedParameter(True) is pickled as a capitalised class called with one bool,
    # as an enum member is; its "value" is requires_grad, which no module loads.
    src = tmp_path / "lazy.pt"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LazyBatchNorm1d())
    torch.save(model.state_dict(), src)
    report = ct.sanitize(src, tmp_path / "plain.pt")
    out = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert out.keys() == {"0.weight", "0.bias", "1.num_batches_tracked"}
    assert report.converted == ()
    lazy = ("weight", "bias", "running_mean", "running_var")
    assert report.dropped == tuple(f"1.{k}" for k in lazy)
    assert "1.weight: uninitialized parameter of a lazy module" in str(report.dropped_values[0])
    assert "1.running_var: uninitialized buffer of a lazy module" in str(report.dropped_values[3])
    torch.nn.Linear(4, 4).load_state_dict({k[2:]: v for k, v in out.items() if k[0] == "0"})
    with pytest.raises(ct.UnsafeContentError, match=r"1\.weight: uninitialized parameter"):
        ct.sanitize(src, tmp_path / "strict.pt", refuse_unsafe=True)
    assert not (tmp_path / "strict.pt").exists()


def test_cli_json_report_and_a_real_process(fake, tmp_path):
    src, original = _lightning(fake, tmp_path)
    dst = tmp_path / "out.pt"
    result = subprocess.run(
        [CKPT, "sanitize", str(src), str(dst), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {"path": "callbacks.payload", "was": "posix.system object", "became": "dropped"} in (
        data["dropped_values"]
    )
    assert any(c["path"] == "config.big_endian" for c in data["converted"])
    # A real process loads it with nothing but torch.
    check = "import sys, torch; print(len(torch.load(sys.argv[1], weights_only=True)))"
    loaded = subprocess.run(
        [sys.executable, "-c", check, str(dst)], capture_output=True, text=True, timeout=120
    )
    assert loaded.returncode == 0 and loaded.stdout.strip() == "12", loaded.stderr
    text = CliRunner().invoke(cli, ["sanitize", str(src), str(dst), "--force"])
    assert text.exit_code == 0, text.output
    assert "callbacks.payload: posix.system object -> dropped" in text.output
    assert not original["marker"].exists()


def test_pickled_model_at_the_root_becomes_its_state_dict(fake, tmp_path):
    model = fake.Net()
    want = model.state_dict()
    src = tmp_path / "model.pt"
    torch.save(model, src)
    _forget(tmp_path)
    report = ct.sanitize(src, tmp_path / "sd.pt")
    out = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert list(out) == list(want) and all(_raw(out[k]) == _raw(want[k]) for k in want)
    assert [str(c) for c in report.converted] == [
        "<root>: pickled nn.Module fakeomega_i10.Net -> state dict (7 entries)"
    ]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # weight_norm is deprecated
def test_a_model_with_spectral_and_weight_norm_becomes_its_state_dict(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.utils.spectral_norm(torch.nn.Linear(4, 3)),
        torch.nn.utils.weight_norm(torch.nn.Linear(3, 2)),
    )
    model(torch.randn(2, 4))  # a power iteration: weight_u moves off its first value
    want = model.state_dict()
    src = tmp_path / "normed.pt"
    torch.save(model, src)
    report = ct.sanitize(src, tmp_path / "sd.pt")
    out = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert list(out) == list(want) and all(_raw(out[k]) == _raw(want[k]) for k in want)
    (change,) = report.converted
    assert str(change).startswith("<root>: pickled nn.Module torch.nn.modules.container.Sequential")
    assert str(change).endswith("-> state dict (7 entries)")


class _Forged:
    """Pickles as whatever ``__reduce__`` names; nothing checks the arguments on the way out."""

    def __init__(self, reduced: tuple[Any, ...]) -> None:
        self.reduced = reduced

    def __reduce__(self):
        return self.reduced


def _rebuild(state: tuple[Any, ...]) -> _Forged:
    return _Forged((np._core.multiarray._reconstruct, (np.ndarray, (0,), b"b"), state))


@pytest.mark.parametrize(
    "forged",
    [
        _rebuild((1, (3,), np.dtype("f4"), False, b"\0" * 8)),  # 8 bytes for 12
        _rebuild((1, (2,), np.dtype([("a", "f4")]), False, b"\0" * 8)),  # structured
        _rebuild((1, (2,), np.dtype("O"), False, [1, 2])),  # object array
        _rebuild((1, (2,), np.dtype("U3"), False, b"\0" * 24)),  # strings
        _Forged((np._core.multiarray.scalar, (np.dtype("f8"), b"\0" * 3))),
    ],
)
def test_malformed_numpy_records_are_dropped_not_guessed(forged):
    tree = load_pickle(io.BytesIO(pickle.dumps({"x": forged, "y": 1}, protocol=2))).root
    done = sanitize_tree(tree, set())
    assert done.root == {"y": 1} and done.added == {}
    assert [c.path for c in done.dropped] == ["x"]


def test_new_records_do_not_reuse_the_source_keys():
    arr = np.arange(3, dtype=np.int16)
    tree = load_pickle(io.BytesIO(pickle.dumps([arr, arr, arr.copy()], protocol=2))).root
    done = sanitize_tree(tree, {"0", "1", "3"})
    assert len(done.added) == 2 and not set(done.added) & {"0", "1", "3"}  # shared: one record
    assert done.root[0] is done.root[1]


# Committed fixtures torch.load(weights_only=True) reads: sanitizing them changes nothing.
PLAIN_FIXTURES = [
    "plain.pt",
    "legacy.pt",
    "py2_legacy.pt",
    "tar_format.pt",
    "lightning.ckpt",
    "trainer_adam.pt",
    "dtypes.pt",
    "tied_views.pt",
    "legacy_tied_views.pt",
    "module.pt",
]


def _assert_same_tree(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
            want.dtype,
            want.shape,
            want.stride(),
            want.storage_offset(),
        ), where
        assert _raw(got) == _raw(want) and type(got) is type(want), where
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want), where
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), where
        for key in want:
            _assert_same_tree(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same_tree(a, b, f"{where}.{i}")
    else:
        assert got == want and type(got) is type(want), where


def _sharing(tree: Any) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, t in h.walk_tensors(tree):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return sorted(groups.values())


@pytest.mark.parametrize("name", PLAIN_FIXTURES)
def test_plain_fixtures_come_out_as_torch_loads_them(name, fixture_copy, tmp_path):
    src = fixture_copy(name)
    # torch reads the tar format only with weights_only=False (a committed, plain fixture):
    # after sanitize, weights_only=True reads it too.
    want = torch.load(src, weights_only=name != "tar_format.pt")
    report = ct.sanitize(src, tmp_path / "out.pt", verify="full")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    _assert_same_tree(got, want)
    assert _sharing(got) == _sharing(want)
    assert report.converted == () and report.dropped == ()


def test_safetensors_and_evil_fixtures(fixture_copy, tmp_path):
    import safetensors.torch

    src = fixture_copy("model.safetensors")
    ct.sanitize(src, tmp_path / "st.pt")
    _assert_same_tree(
        torch.load(tmp_path / "st.pt", weights_only=True), safetensors.torch.load_file(src)
    )
    evil = fixture_copy("evil.pt")
    report = ct.sanitize(evil, tmp_path / "evil_out.pt")
    out = torch.load(tmp_path / "evil_out.pt", weights_only=True)
    assert list(out) == ["state_dict"] and [str(c) for c in report.dropped_values] == [
        "payload: posix.system object -> dropped"
    ]
    assert not list(tmp_path.rglob("PWNED_MARKER")) and not Path("PWNED_MARKER").exists()


def test_verification_refuses_an_output_that_names_a_global(tmp_path):
    from ckpt_tools.formats import open_checkpoint
    from ckpt_tools.ops.sanitize.sanitizing import _verify
    from ckpt_tools.ops.sanitize.tree import SanitizedTree

    written = tmp_path / "written.pt"  # as if the writer had let a global through
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, written)
    source = open_checkpoint(str(written))
    plan = SanitizedTree({"w": source.root["w"]}, (), ())
    with pytest.raises(ct.VerificationError, match=r"argparse\.Namespace"):
        _verify(str(written), plan, (), source, "sizes")
    assert _verify(str(written), plan, (), source, "none").startswith("not verified")


def test_sanitize_never_imports_torch(fake, tmp_path, no_torch_env):
    src, original = _lightning(fake, tmp_path)
    dst = tmp_path / "out.pt"
    h.run_ckpt("sanitize", src, dst, how="script", env=no_torch_env)
    out = torch.load(dst, weights_only=True)  # torch only here, in the test
    assert list(out["pickled_model"]) == list(original["model_sd"])
    assert not original["marker"].exists()


def test_a_value_dropped_inside_a_config_node_or_as_a_key_is_listed_once(fake, tmp_path):
    # The thing dropped is listed at its place, once: not again as the node holding it, nor
    # again as the entry its key would have made.
    src = tmp_path / "inner.ckpt"
    marker = tmp_path / "PAYLOAD_RAN"
    cfg = fake.DictConfig({"lr": 0.1, "hook": fake.Payload(marker)})
    meta = {fake.Mode.TRAIN: 1, "kept": 2, fake.Payload(marker): 3}
    torch.save({"state_dict": {"w": torch.ones(2)}, "cfg": cfg, "meta": meta}, src)
    _forget(tmp_path)
    report = ct.sanitize(src, tmp_path / "plain.ckpt")
    out = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    assert out["cfg"] == {"lr": 0.1} and out["meta"] == {"train": 1, "kept": 2}
    dropped = [c.path for c in report.dropped_values]
    assert len(dropped) == 2 and dropped[0] == "cfg.hook", dropped
    assert dropped[1].startswith("meta.") and "system" in dropped[1], dropped
    assert not marker.exists()


def test_a_selection_sanitize_drops_is_refused_before_writing(fake, tmp_path):
    # --select names the state dict the output is verified by: an object sanitize drops (a
    # class it cannot keep, whose attributes the input's selection followed) is refused
    # before anything is written, dry run included, rather than failing that verification.
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "meta": fake.Metadata("k")}, src)
    _forget(tmp_path)
    assert ct.inspect(src, select="meta").selected == ("meta",)
    said = r"select='meta': sanitize drops meta \(fakeomega_i10\.Metadata object\)"
    for dry_run in (False, True):
        with pytest.raises(ct.SelectError, match=said) as e:
            ct.sanitize(src, dst, select="meta", dry_run=dry_run)
        assert "pass select=None to verify the state dict found in the output" in str(e.value)
    result = h.run_ckpt("sanitize", src, dst, "--select", "meta", code=2)
    assert "--select 'meta': sanitize drops meta" in result.stderr
    assert "leave out --select" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.pt", "src"]
    report = ct.sanitize(src, dst, select="state_dict")
    assert report.dropped == ("meta",) and report.verification.startswith("verified: 1 ")


def test_a_selection_inside_a_converted_object_names_what_it_became(fake, tmp_path):
    # A pickled module becomes its state dict: a path through its attributes is gone from
    # the output, and the error names the selection that verifies what it became.
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"net": fake.Net(), "epoch": 1}, src)
    torch.save({"my net": fake.Net(), "epoch": 1}, tmp_path / "spaced.pt")
    _forget(tmp_path)
    inner = "net._modules.fc._parameters"
    assert ct.inspect(src, select=inner).selected == tuple(inner.split("."))
    with pytest.raises(ct.SelectError, match=r"sanitize converts net \(pickled nn\.Module") as e:
        ct.sanitize(src, dst, select=inner)
    assert "pass select='net' to verify what net became" in str(e.value)
    result = h.run_ckpt("sanitize", src, dst, "--select", inner, code=2)
    assert "pass --select net to verify what net became" in result.stderr
    assert not dst.exists()
    report = ct.sanitize(src, dst, select="net")
    assert report.tensors == len(torch.load(dst, weights_only=True)["net"])
    # A name that is two shell words is suggested as one.
    spaced = tmp_path / "spaced.pt"
    said = h.run_ckpt("sanitize", spaced, tmp_path / "o2.pt", "--select", "my net._modules", code=2)
    assert "pass --select 'my net' to verify what my net became" in said.stderr


def test_bare_storages_are_kept_as_torch_loads_them(tmp_path: Path) -> None:
    # torch.load(weights_only=True) reads a storage saved on its own: nothing to make plain.
    shared = torch.arange(3.0).untyped_storage()
    with warnings.catch_warnings():  # TypedStorage is deprecated, and still saved and loaded
        warnings.simplefilter("ignore")
        typed = torch.arange(4).storage()
    src = tmp_path / "storages.pt"
    torch.save({"s": shared, "again": [shared], "typed": typed, "w": torch.ones(2)}, src)
    result = ct.sanitize(src, tmp_path / "out.pt", refuse_unsafe=True, verify="full")
    assert result.dropped_values == () and result.converted == ()
    before = torch.load(src, weights_only=True)
    after = torch.load(tmp_path / "out.pt", weights_only=True)
    assert (
        bytes(after["s"]) == bytes(before["s"])
        and after["again"][0].data_ptr() == after["s"].data_ptr()
    )
    assert type(after["typed"]) is type(before["typed"]) and after["typed"].dtype == torch.int64
    assert list(after["typed"]) == [0, 1, 2, 3] and torch.equal(after["w"], torch.ones(2))


def test_a_file_saved_on_a_gpu_says_where_its_output_loads(tmp_path: Path) -> None:
    # torch.load puts tensors back on the device they were saved on: the promise says so.
    torch.save({"w": torch.ones(2)}, tmp_path / "cpu.pt")
    ct.retag(tmp_path / "cpu.pt", tmp_path / "gpu.pt", mapping={"cpu": "cuda:1"})
    on_gpu = ct.sanitize(tmp_path / "gpu.pt", tmp_path / "out.pt").message
    assert on_gpu.endswith(
        "loads with torch.load(weights_only=True) (saved on cuda:1: where that is missing, "
        "pass map_location='cpu')"
    )
    out = torch.load(tmp_path / "out.pt", weights_only=True, map_location="cpu")
    assert torch.equal(out["w"], torch.ones(2))
    on_cpu = ct.sanitize(tmp_path / "cpu.pt", tmp_path / "out2.pt").message
    assert on_cpu.endswith("loads with torch.load(weights_only=True)")


class _Holder:
    """An object sanitize drops, with what it holds."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_a_gpu_tensor_in_a_dropped_object_is_not_said_to_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = torch.serialization.location_tag
    monkeypatch.setattr(  # the held tensor "saved on the GPU", the weights on the CPU
        torch.serialization, "location_tag", lambda s: "cuda:0" if s.nbytes() == 12 else tag(s)
    )
    torch.save({"model": {"w": torch.ones(2)}, "thing": _Holder(torch.ones(3))}, tmp_path / "m.pt")
    monkeypatch.undo()
    result = ct.sanitize(tmp_path / "m.pt", tmp_path / "out.pt")
    assert [c.path for c in result.dropped_values] == ["thing"]
    assert result.message.endswith("loads with torch.load(weights_only=True)")
    assert torch.load(tmp_path / "out.pt", weights_only=True)["model"]["w"].device.type == "cpu"
