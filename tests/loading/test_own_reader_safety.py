"""load_state_dict never unpickles with anything but our restricted reader unless trust=True.

A spy replaces ``torch.load`` (and torch's weights-only unpickler) with functions that raise,
and a profile hook sees every ``load``/``loads`` call of the C pickle module: each must be
made on ckpt_tools' restricted unpickler. Real-world shapes of checkpoints with objects of
unimportable classes outside the state dict (Lightning-style hparams, numpy arrays in a
config, a ``__reduce__`` payload) load without trust; the payload never runs.
"""

from __future__ import annotations

import _pickle
import argparse
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckpt_tools import load_state_dict, load_with_info
from ckpt_tools.errors import UnsafeContentError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.detect import _NoGlobals
from ckpt_tools.formats.pickle.restricted import _Restricted

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


class _Forbidden(AssertionError):
    pass


def _forbid(name: str) -> Any:
    def raising(*args: Any, **kwargs: Any) -> Any:
        raise _Forbidden(f"{name} was called")

    return raising


def _is_restricted(kind: type) -> bool:
    """One of ckpt_tools' own unpicklers, whose find_class imports nothing: the reader's
    (globals to stand-ins) and format detection's (every global refused)."""
    return kind.__module__.startswith("ckpt_tools.formats.") and (
        issubclass(kind, _Restricted) or kind is _NoGlobals
    )


@pytest.fixture
def unpickling_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Makes torch.load & co. raise; collects C-level pickle loads not made by our reader."""
    import torch._weights_only_unpickler as wo

    for owner, name in [
        (torch, "load"),
        (torch.serialization, "load"),
        (torch.serialization, "_load"),
        (torch.serialization, "_legacy_load"),
        (wo, "load"),
        (wo.Unpickler, "load"),
        (pickle, "load"),
        (pickle, "loads"),
        (pickle._Unpickler, "load"),  # type: ignore[attr-defined]
    ]:
        monkeypatch.setattr(owner, name, _forbid(f"{getattr(owner, '__name__', owner)}.{name}"))
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "c_call" or getattr(arg, "__name__", "") not in ("load", "loads"):
            return
        owner = getattr(arg, "__self__", None)
        if owner is _pickle or (
            isinstance(owner, _pickle.Unpickler) and not _is_restricted(type(owner))
        ):
            calls.append(f"{type(owner).__name__}.{arg.__name__}")

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def test_the_spy_sees_torch_load_and_a_plain_unpickler(
    tmp_path: Path, unpickling_calls: list[str]
) -> None:
    # The spy itself can fail: both routes of unpickling are caught.
    path = tmp_path / "w.pt"
    path.write_bytes((FIXTURES / "plain.pt").read_bytes())
    with pytest.raises(_Forbidden):
        torch.load(path)
    _pickle.Unpickler(open(FIXTURES / "numbers_p4.pkl", "rb")).load()  # noqa: SIM115
    assert unpickling_calls == ["Unpickler.load"]


@pytest.mark.parametrize(
    "name", ["plain.pt", "lightning.ckpt", "legacy.pt", "tar_format.pt", "model.safetensors"]
)
def test_load_state_dict_calls_no_unrestricted_unpickler(
    name: str, unpickling_calls: list[str]
) -> None:
    sd = load_state_dict(FIXTURES / name)
    assert sd and all(isinstance(v, torch.Tensor) for v in sd.values())
    assert unpickling_calls == []


def test_trust_is_the_only_way_to_torch_load(unpickling_calls: list[str]) -> None:
    with pytest.raises(_Forbidden, match="load was called"):
        load_state_dict(FIXTURES / "plain.pt", trust=True)


# --- payloads and foreign classes outside the state dict ---------------------------------

_PAYLOAD_MODULE = '''
import pathlib


def make_marker(path):
    pathlib.Path(path).write_text("ran")
    return {"ran": True}


class Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (make_marker, (self.path,))


class DictConfig(dict):
    """Like OmegaConf's: a dict subclass with its own attributes."""

    def __init__(self, content):
        super().__init__(content)
        self._flags = {"readonly": False}


class Hparams:
    def __init__(self, **kw):
        self.__dict__.update(kw)
'''


@pytest.fixture
def foreign_checkpoint(tmp_path: Path) -> Iterator[tuple[Path, Path, dict[str, torch.Tensor]]]:
    """A Lightning-style checkpoint whose extras come from a module that is then removed."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "foreign_mod_i10.py").write_text(textwrap.dedent(_PAYLOAD_MODULE))
    marker = tmp_path / "MARKER"
    sys.path.insert(0, str(package))
    try:
        import foreign_mod_i10 as foreign  # type: ignore[import-not-found]

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
        weights = model.state_dict()
        path = tmp_path / "lightning.ckpt"
        torch.save(
            {
                "state_dict": weights,
                "hyper_parameters": foreign.DictConfig({"lr": 0.1, "cfg": foreign.Hparams(k=2)}),
                "config": {"mean": np.arange(6, dtype=np.float32).reshape(2, 3), "seed": 7},
                "optimizer_states": [{"extra": argparse.Namespace(betas=(0.9, 0.99))}],
                "callbacks": foreign.Payload(str(marker)),
                "pytorch-lightning_version": "2.4.0",
                "global_step": 3,
            },
            path,
        )
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("foreign_mod_i10", None)
    yield path, marker, {k: v.clone() for k, v in weights.items()}


def test_foreign_objects_outside_the_state_dict_load_untrusted_and_never_run(
    foreign_checkpoint: tuple[Path, Path, dict[str, torch.Tensor]],
    unpickling_calls: list[str],
) -> None:
    path, marker, weights = foreign_checkpoint
    ckpt = open_checkpoint(path)
    assert {"foreign_mod_i10.make_marker", "foreign_mod_i10.DictConfig"} <= set(ckpt.unsafe_globals)
    sd, info = load_with_info(path)
    assert info.selected == ("state_dict",) and not info.trusted
    assert list(sd) == list(weights)
    for key, value in weights.items():
        assert sd[key].dtype == value.dtype and torch.equal(sd[key], value), key
    assert not marker.exists()
    assert unpickling_calls == []
    assert "foreign_mod_i10" not in sys.modules


def test_the_payload_is_real_torch_load_runs_it(
    foreign_checkpoint: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    # Proof that the marker test above can fail: with the module importable and trust,
    # torch.load runs the payload (in a subprocess, so nothing of it stays here).
    path, marker, _ = foreign_checkpoint
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]); from ckpt_tools import load_state_dict; "
        "load_state_dict(sys.argv[1], trust=True)"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(path), str(path.parent / "pkg")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert marker.read_text() == "ran"


def test_a_foreign_object_inside_the_state_dict_is_refused_by_name(
    tmp_path: Path, foreign_checkpoint: tuple[Path, Path, dict[str, torch.Tensor]]
) -> None:
    path, marker, _ = foreign_checkpoint
    # The root taken as the state dict holds every foreign object: all are named at once.
    with pytest.raises(
        UnsafeContentError, match=r"'callbacks' \(foreign_mod_i10\.make_marker\)"
    ) as info:
        load_state_dict(path, select="")
    assert "'hyper_parameters' (foreign_mod_i10.DictConfig)" in str(info.value)
    assert set(info.value.globals) >= {"foreign_mod_i10.make_marker", "argparse.Namespace"}
    assert not marker.exists()
