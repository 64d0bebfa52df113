"""Verification compares what ``torch.load`` sets besides a tensor's bytes: the conjugate and
negative view bits, ``requires_grad``, ``nn.Parameter``-ness and the saved device tag.

The oracle is ``torch.load``: a written output verifies exactly when it loads as the input
does, and a file that lost (or gained) one of these is refused, at every level that compares
dtypes and shapes, though its bytes and geometry are the planned ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.cli.main import main
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.errors import VerificationError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.io.verify.outputs import Expected, verify_output
from ckpt_tools.structure.selection import select_state_dict
from tests import helpers as h

LEVELS = ("sizes", "full")


def _complex() -> torch.Tensor:
    return torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j])


def _views() -> dict[str, torch.Tensor]:
    """Tensors whose loaded values depend on a bit or flag beside their bytes."""
    return {
        "neg": torch.arange(4.0)._neg_view(),
        "conj": _complex().conj(),
        "both": _complex().conj()._neg_view(),
        "param": torch.nn.Parameter(torch.ones(2)),
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "grad": torch.ones(3).requires_grad_(),
        "plain": torch.arange(3.0),
    }


def _expected(path: Path, select: str | None = None, **fields: Any) -> Expected:
    ckpt = open_checkpoint(path)
    selection = select_state_dict(ckpt.root, select=select)
    kinds = (TensorRef, RebuiltTensor)
    tensors = {k: v for k, v in selection.state_dict.items() if isinstance(v, kinds)}
    return Expected(tensors, selection.path, ckpt, rebuilt=True, **fields)


def _same_as_loaded(got: Any, want: Any) -> None:
    """``torch.load`` of the output gives the input's tensors: values, bits and flags."""
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert (g.is_conj(), g.is_neg()) == (w.is_conj(), w.is_neg()), k
        assert (type(g), g.requires_grad) == (type(w), w.requires_grad), k
        assert torch.equal(
            g.detach().resolve_conj().resolve_neg(), w.detach().resolve_conj().resolve_neg()
        ), k


@pytest.mark.parametrize(
    ("command", "select"),
    [
        (["strip-module"], None),
        (["convert"], None),
        (["slim", "--drop", "optimizer"], "model"),
        (["extract", "--prefix", "module."], "model"),
        (["sanitize"], None),
    ],
)
@pytest.mark.parametrize("level", LEVELS)
def test_outputs_of_the_commands_keep_bits_and_flags(
    command: list[str], select: str | None, level: str, tmp_path: Path
) -> None:
    sd = {f"module.{k}": v for k, v in _views().items()}
    obj: dict[str, Any] = {"model": sd, "optimizer": {"lr": 0.1}} if select else sd
    src = h.save(obj, tmp_path / "in.pt")
    out = tmp_path / "out.pt"
    argv = [command[0], str(src), str(out), *command[1:], "--verify", level, "-q"]
    assert main(argv) == 0
    loaded = torch.load(out, weights_only=True)
    stripped = {k.removeprefix("module."): v for k, v in sd.items()}
    if command[0] == "strip-module":
        _same_as_loaded(loaded, stripped)
    elif command[0] == "extract":
        _same_as_loaded(loaded, sd)
    else:
        _same_as_loaded(loaded["model"] if select else loaded, sd)


@pytest.mark.parametrize(
    ("planned", "written", "said"),
    [
        ({"w": lambda x: x._neg_view()}, {"w": lambda x: x}, "no view bit"),
        ({"w": lambda x: x}, {"w": lambda x: x._neg_view()}, "a negative"),
        ({"w": lambda x: x.conj()}, {"w": lambda x: x}, "no view bit"),
        ({"w": lambda x: x.conj()._neg_view()}, {"w": lambda x: x.conj()}, "a conjugate view"),
    ],
)
@pytest.mark.parametrize("level", LEVELS)
def test_a_lost_or_added_view_bit_is_refused(
    planned: dict[str, Any], written: dict[str, Any], said: str, level: str, tmp_path: Path
) -> None:
    # The same bytes under the same name, saved with other bits: only the bit tells them apart.
    x = _complex()
    a = h.save({k: f(x) for k, f in planned.items()}, tmp_path / "planned.pt")
    b = h.save({k: f(x) for k, f in written.items()}, tmp_path / "written.pt")
    loaded_a, loaded_b = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert not torch.equal(
        loaded_a["w"].resolve_conj().resolve_neg(), loaded_b["w"].resolve_conj().resolve_neg()
    )
    with pytest.raises(
        VerificationError, match=rf"^'w' reads back as {said}.*, expected .*view"
    ) as e:
        verify_output(str(b), _expected(a), level)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("level", LEVELS)
def test_a_resolved_tensor_is_refused_against_a_plan_with_the_bit(
    level: str, tmp_path: Path
) -> None:
    a = h.save({"w": torch.arange(4.0)._neg_view()}, tmp_path / "a.pt")
    b = h.save({"w": torch.load(a, weights_only=True)["w"].resolve_neg()}, tmp_path / "b.pt")
    match = r"'w' reads back as no view bit, expected a negative view"
    with pytest.raises(VerificationError, match=match):
        verify_output(str(b), _expected(a), level)


@pytest.mark.parametrize(
    ("planned", "written", "match"),
    [
        (
            torch.ones(2).requires_grad_(),
            torch.ones(2),
            "requires_grad=False, expected requires_grad=True",
        ),
        (
            torch.nn.Parameter(torch.ones(2)),
            torch.ones(2).requires_grad_(),
            "a plain tensor, expected an nn.Parameter",
        ),
        (
            torch.ones(2),
            torch.nn.Parameter(torch.ones(2), requires_grad=False),
            "an nn.Parameter, expected a plain",
        ),
    ],
)
@pytest.mark.parametrize("level", LEVELS)
def test_a_changed_flag_is_refused(
    planned: torch.Tensor, written: torch.Tensor, match: str, level: str, tmp_path: Path
) -> None:
    a = h.save({"w": planned}, tmp_path / "a.pt")
    b = h.save({"w": written}, tmp_path / "b.pt")
    with pytest.raises(VerificationError, match=f"^'w' reads back .*{match}"):
        verify_output(str(b), _expected(a), level)


def test_the_saved_device_tag_is_compared_through_the_mapping(tmp_path: Path) -> None:
    a = h.save({"w": torch.ones(2), "b": torch.ones(1)}, tmp_path / "a.pt")
    assert main(["retag", str(a), str(tmp_path / "b.pt"), "--map", "cpu=cuda:1", "-q"]) == 0
    b = str(tmp_path / "b.pt")
    assert verify_output(b, _expected(a, devices={"cpu": "cuda:1"})).startswith("verified: 2")
    assert verify_output(b, _expected(a)).startswith("verified: 2")  # tags left uncompared
    with pytest.raises(
        VerificationError, match=r"^'w' reads back saved on 'cuda:1', expected 'cpu'"
    ):
        verify_output(b, _expected(a, devices={}))


def test_a_meta_tensor_with_other_strides_is_refused(tmp_path: Path) -> None:
    a = h.save({"m": torch.empty(2, 3, device="meta")}, tmp_path / "a.pt")
    b = h.save({"m": torch.empty_strided((2, 3), (1, 2), device="meta")}, tmp_path / "b.pt")
    with pytest.raises(VerificationError, match=r"^'m' reads back with strides \[1, 2\]"):
        verify_output(str(b), _expected(a), "sizes")
    assert verify_output(str(a), _expected(a), "sizes").startswith("verified: 1")


def test_a_safetensors_output_is_held_to_the_bits_only(tmp_path: Path) -> None:
    # safetensors keeps no gradients or parameters: a torch plan's flags are not asked of it.
    a = h.save({"w": torch.nn.Parameter(torch.ones(2))}, tmp_path / "a.pt")
    out = tmp_path / "a.safetensors"
    assert main(["convert", str(a), str(out), "-q"]) == 0
    assert verify_output(str(out), _expected(a), "full").startswith("verified: 1")
