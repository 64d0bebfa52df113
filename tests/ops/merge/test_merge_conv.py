"""LoRA on convolutions (``nn.Conv1d``, ``Conv2d``, ``Conv3d``) merged as PEFT merges them: A
is a kernel ``(r, in, *k)``, B a 1-wide one ``(out, r, 1, ...)``, and the delta their
convolution. Checked against PEFT's ``merge_and_unload()``, and, where PEFT's own merge fails,
against the adapted model's output."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed
from tests.ops.merge.test_merge_lora import EXACT, compare, make_case

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")


class Convs(nn.Module):
    """One convolution of each rank, a 1x1 one (which PEFT merges by matmul) and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 5)
        self.c2 = nn.Conv2d(6, 8, 3, padding=1)
        self.pointwise = nn.Conv2d(8, 8, 1)
        self.c3 = nn.Conv3d(2, 4, (2, 3, 3))
        self.fc = nn.Linear(5, 7)


class Columns(nn.Module):
    """A Conv3d whose kernel is 1x1 in its first two dimensions, and a grouped Conv2d."""

    def __init__(self) -> None:
        super().__init__()
        self.column = nn.Conv3d(2, 4, (1, 1, 3))
        self.grouped = nn.Conv2d(8, 8, 3, groups=2)


def _lora(*names: str, **kwargs: Any) -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(names), **kwargs)


ALL = ("c1", "c2", "pointwise", "c3", "fc")


@pytest.mark.parametrize(
    ("dtype", "options"),
    [
        (torch.float32, {}),
        (torch.float32, {"lora_bias": True}),
        (torch.float32, {"use_dora": True}),
        (torch.bfloat16, {}),
        (torch.float16, {"use_dora": True}),
    ],
    ids=["fp32", "lora-bias", "dora", "bf16", "fp16-dora"],
)
def test_convolutions_merge_as_peft_merges_them(
    tmp_path: Path, dtype: torch.dtype, options: dict[str, Any]
) -> None:
    case = make_case(tmp_path / "case", Convs, _lora(*ALL, **options), dtype=dtype)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "merged.pt")
    dora = "+dora" if options.get("use_dora") else ""
    kinds = {m.module: m.kind for m in result.merged}
    assert kinds == {
        **{name: f"convolution{dora}" for name in ALL[:-1]},
        "fc": f"linear{dora}",
    }
    # DoRA's norm of a row shorter than torch's 8 lanes (fc's 5) is reduced in another order
    # than the merge follows: within the bound, not bit for bit.
    compare(torch.load(tmp_path / "merged.pt"), case, exact=EXACT and not dora)


def _channels_last() -> Convs:
    model = Convs()
    model.c2.to(memory_format=torch.channels_last)
    model.pointwise.to(memory_format=torch.channels_last)
    model.c3.to(memory_format=torch.channels_last_3d)
    return model


@pytest.mark.parametrize("name", ["merged.pt", "merged.safetensors"])
@pytest.mark.parametrize(
    "options",
    [{}, {"use_dora": True}, {"modules_to_save": ["pointwise"]}],
    ids=["lora", "dora", "saved"],
)
def test_a_channels_last_base_merges_as_peft_merges_it(
    tmp_path: Path, options: dict[str, Any], name: str
) -> None:
    # Each kernel covers its storage with its channels innermost; PEFT merges it in place.
    targets = [n for n in ALL if n not in options.get("modules_to_save", ())]
    case = make_case(tmp_path / "case", _channels_last, _lora(*targets, **options))
    assert not case.base_sd["c2.weight"].is_contiguous()
    assert not case.base_sd["c3.weight"].is_contiguous()
    ct.merge_lora(case.base, case.adapter, tmp_path / name)
    if name.endswith(".pt"):
        out = torch.load(tmp_path / name)
        # The output keeps the layout, as PEFT's merge in place keeps it.
        for key in ("c2.weight", "pointwise.weight", "c3.weight"):
            assert out[key].stride() == case.base_sd[key].stride()
        assert not case.merged["c2.weight"].is_contiguous()
    else:
        from safetensors.torch import load_file

        out = load_file(tmp_path / name)
    # (torch reduces a channels-last kernel's norm in its memory order: within the bound)
    exact = EXACT and "use_dora" not in options
    compare({k: v.contiguous() for k, v in out.items()}, case, exact=exact)


def test_a_kernel_peft_cannot_merge_merges_to_the_adapted_models_output(tmp_path: Path) -> None:
    # PEFT's merge takes a Conv3d kernel of (1, 1, k) for a 1x1 one and fails on it; the
    # merged weight must still compute what the adapted layer computes.
    torch.manual_seed(0)
    base = Columns()
    torch.save(base.state_dict(), tmp_path / "base.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.get_peft_model(copy.deepcopy(base), _lora("column"))
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    adapted.save_pretrained(tmp_path / "adapter")
    with pytest.raises(RuntimeError):
        adapted.merge_and_unload()

    result = ct.merge_lora(tmp_path / "base.pt", tmp_path / "adapter", tmp_path / "merged.pt")
    assert [m.kind for m in result.merged] == ["convolution"]
    merged = Columns()
    merged.load_state_dict(torch.load(tmp_path / "merged.pt"))
    x = torch.randn(3, 2, 4, 5, 6)
    with torch.no_grad():
        want = adapted.base_model.model.column(x)
        assert not torch.allclose(want, base.column(x), atol=1e-3)  # the adapter changes it
        torch.testing.assert_close(merged.column(x), want)


def test_a_grouped_convolution_is_refused_as_peft_refuses_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    torch.save(Columns().state_dict(), tmp_path / "base.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = peft.get_peft_model(Columns(), _lora("grouped"))
        with pytest.raises(NotImplementedError):
            adapted.merge_and_unload()
    adapted.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ConversionError, match=r"'grouped' is LoRA on a grouped convolution"):
        ct.merge_lora(tmp_path / "base.pt", tmp_path / "adapter", tmp_path / "merged.pt")
    assert not (tmp_path / "merged.pt").exists()
    r = run_ckpt(
        "merge-lora", tmp_path / "base.pt", tmp_path / "adapter", tmp_path / "m.pt", code=7
    )
    assert "groups=2" in r.stderr


def test_a_kernel_of_another_size_does_not_fit(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", Convs, _lora("c2"))
    other = Convs()
    other.c2 = nn.Conv2d(6, 8, 5)
    torch.save(other.state_dict(), tmp_path / "other.pt")
    with pytest.raises(ConversionError, match=r"c2\.weight: shape \[8, 6, 5, 5\] does not fit"):
        ct.merge_lora(tmp_path / "other.pt", case.adapter, tmp_path / "merged.pt")
