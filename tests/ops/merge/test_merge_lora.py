"""merge_lora against PEFT's own merge: tiny models from configs, LoRA applied and trained a
little (B made non-zero), ``merge_and_unload()`` the expected output.

Plain LoRA merges are bitwise PEFT's. DoRA's row norm is summed in the order of torch's AVX2
kernel; a torch using other vector widths sums in another, so DoRA outputs are held to one
unit in the last place plus 2**-16 of the tensor's largest magnitude. Tensors not merged are
bitwise the base's.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, tiny_gpt2, tiny_llama

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")
transformers = ImportedWhenUsed("transformers")


def _exact() -> bool:
    """Whether torch here forms ``B @ A`` and DoRA's row norm as the merge does: ATen's AVX2
    kernels (the norm's 8 lanes) and a matmul that sums a rank's products in order, one fused
    multiply-add each (MKL's sgemm does on some CPUs, not on all). Elsewhere torch may round
    differently, within the bound of :func:`ulp_bound`."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    from ckpt_tools.ops.merge.arithmetic import matmul

    generator = torch.Generator().manual_seed(0)
    for rank, n in ((4, 32), (8, 200), (16, 1024)):
        b, a = torch.randn(n, rank, generator=generator), torch.randn(rank, n, generator=generator)
        if not torch.equal(torch.from_numpy(matmul(b.numpy(), a.numpy())), b @ a):
            return False
    return True


EXACT = _exact()


class Case(NamedTuple):
    base: Path  # the base checkpoint as saved
    adapter: Path  # the adapter folder PEFT saved
    base_sd: dict[str, torch.Tensor]
    merged: dict[str, torch.Tensor]  # merge_and_unload()'s state dict


def _llama_tied() -> Any:
    # Tied embeddings (Llama 3.2 1B, Qwen2.5 0.5B): save_pretrained leaves lm_head out, so
    # every key it writes starts with "model.".
    return tiny_llama(layers=1, tie_word_embeddings=True)


def _perturb(model: Any, seed: int) -> None:
    """Move every trainable parameter off its initial value (B starts at zero): the adapter's,
    its ``modules_to_save`` copies', and the biases ``bias="lora_only"`` or ``"all"`` trains."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def make_case(
    folder: Path,
    build: Callable[[], Any],
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    save: Callable[[Any, Path], Path] | None = None,
    autocast: bool = True,
    train_dtype: torch.dtype | None = None,
    **save_kwargs: Any,
) -> Case:
    """Save a tiny model's weights, apply LoRA with PEFT (on a copy in ``train_dtype`` if
    given; 16-bit layers kept 16-bit when not ``autocast``) and save the adapter. The expected
    output is ``PeftModel.from_pretrained``'s merge of the saved adapter into the base."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    model = build().to(dtype)
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    if save is None:
        base = folder / "base.pt"
        torch.save(base_sd, base)
    else:
        base = save(model, folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = model if train_dtype is None else model.to(train_dtype)
        lora = peft.get_peft_model(trained, config, autocast_adapter_dtype=autocast)
        _perturb(lora, 1)
        lora.save_pretrained(folder / "adapter", **save_kwargs)
        # The oracle is the merge of the saved adapter, as one loads and merges it.
        fresh = build().to(dtype)
        fresh.load_state_dict(base_sd)
        loaded = peft.PeftModel.from_pretrained(fresh, folder / "adapter")
        merged = {k: v.clone() for k, v in loaded.merge_and_unload().state_dict().items()}
    return Case(base, folder / "adapter", base_sd, merged)


def ulp_bound(expected: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each expected value, plus 2**-16 of the largest."""
    e = expected.float().abs()
    ulp = torch.nextafter(e.to(expected.dtype), torch.tensor(float("inf"), dtype=expected.dtype))
    return (ulp.float() - e) + e.max() * 2**-16


def compare(out: dict[str, torch.Tensor], case: Case, *, exact: bool = EXACT) -> list[str]:
    """Keys whose merged tensors differ from PEFT's; unmerged tensors must be the base's."""
    assert sorted(out) == sorted(case.base_sd)
    differing = []
    for key, got in out.items():
        want = case.merged.get(key, case.base_sd[key])
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if torch.equal(
            got.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)
        ):
            continue
        differing.append(key)
        assert key in case.merged and not torch.equal(want, case.base_sd[key]), f"{key}: not merged"
        assert not exact, f"{key}: {(got.double() - want.double()).abs().max()}"
        assert close(got, want, exact=exact), key
    return differing


def close(got: torch.Tensor, want: torch.Tensor, *, exact: bool = EXACT) -> bool:
    """Bitwise equal where the merge follows torch's kernels (``exact``), else within the
    bound."""
    if exact:
        return torch.equal(got, want)
    return bool(((got.float() - want.float()).abs() <= ulp_bound(want)).all())


def _targets(*names: str, **kwargs: Any) -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(names), **kwargs)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Case]:
    """Each case built once for the module, on first use."""
    root = tmp_path_factory.mktemp("lora")
    made: dict[str, Case] = {}
    recipes: dict[str, Callable[[Path], Case]] = {
        "linear": lambda f: make_case(f, tiny_llama, _targets("q_proj", "v_proj", "up_proj")),
        "bf16": lambda f: make_case(
            f, tiny_llama, _targets("q_proj", "down_proj"), dtype=torch.bfloat16
        ),
        "bf16-adapter": lambda f: make_case(
            f, tiny_llama, _targets("q_proj", "embed_tokens"), dtype=torch.bfloat16, autocast=False
        ),
        "bf16-adapter-fp32-base": lambda f: make_case(
            f,
            tiny_llama,
            _targets("q_proj", "embed_tokens"),
            train_dtype=torch.bfloat16,
            autocast=False,
        ),
        "rslora": lambda f: make_case(f, tiny_llama, _targets("q_proj", "o_proj", use_rslora=True)),
        "patterns": lambda f: make_case(
            f,
            tiny_llama,
            _targets(
                "q_proj",
                "v_proj",
                rank_pattern={"layers.1.self_attn.q_proj": 2},
                alpha_pattern={"v_proj": 3},
            ),
        ),
        "conv1d": lambda f: make_case(
            f, tiny_gpt2, _targets("c_attn", "c_proj", fan_in_fan_out=True)
        ),
        "embedding": lambda f: make_case(
            f, tiny_llama, _targets("embed_tokens", "q_proj", modules_to_save=["lm_head"])
        ),
        "dora": lambda f: make_case(f, tiny_llama, _targets("q_proj", "down_proj", use_dora=True)),
        "dora-conv1d": lambda f: make_case(
            f, tiny_gpt2, _targets("c_attn", "c_fc", fan_in_fan_out=True, use_dora=True)
        ),
        "bin": lambda f: make_case(
            f, tiny_llama, _targets("q_proj", "k_proj"), safe_serialization=False
        ),
        "lora-bias": lambda f: make_case(f, tiny_gpt2, _targets("c_attn", lora_bias=True)),
        "fp16": lambda f: make_case(f, tiny_llama, _targets("k_proj"), dtype=torch.float16),
        "sharded": lambda f: make_case(
            f, tiny_llama, _targets("q_proj", "gate_proj"), save=_sharded
        ),
        "ddp": lambda f: make_case(f, tiny_llama, _targets("v_proj"), save=_wrapped),
        "tied": lambda f: make_case(f, _llama_tied, _targets("q_proj", "up_proj"), save=_hf),
        "tied-saved-head": lambda f: make_case(
            f, _llama_tied, _targets("q_proj", modules_to_save=["lm_head"]), save=_tied_pt
        ),
    }

    def get(name: str) -> Case:
        if name not in made:
            made[name] = recipes[name](root / name)
        return made[name]

    return get


def _sharded(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder / "base-hf", max_shard_size="20KB")
    assert (folder / "base-hf" / "model.safetensors.index.json").exists()
    return folder / "base-hf"


def _tied_pt(model: Any, folder: Path) -> Path:
    torch.save(model.state_dict(), folder / "base.pt")  # lm_head and embed_tokens: one storage
    return folder / "base.pt"


def _hf(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder / "base-hf")
    return folder / "base-hf"


def _wrapped(model: Any, folder: Path) -> Path:
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, folder / "ddp.pt")
    return folder / "ddp.pt"


@pytest.mark.parametrize(
    "name",
    [
        "linear",
        "bf16",
        "bf16-adapter",
        "bf16-adapter-fp32-base",
        "rslora",
        "patterns",
        "conv1d",
        "embedding",
        "bin",
        "lora-bias",
        "fp16",
    ],
)
def test_merge_is_bitwise_peft(cases: Callable[[str], Case], tmp_path: Path, name: str) -> None:
    case = cases(name)
    weights = "adapter_model.bin" if name == "bin" else "adapter_model.safetensors"
    assert (case.adapter / weights).is_file()
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "merged.pt")
    assert result.merged and not result.dry_run
    compare(torch.load(tmp_path / "merged.pt"), case)


def test_dora_is_within_one_ulp(cases: Callable[[str], Case], tmp_path: Path) -> None:
    for name in ("dora", "dora-conv1d"):
        case = cases(name)
        result = ct.merge_lora(case.base, case.adapter, tmp_path / f"{name}.safetensors")
        assert {m.kind for m in result.merged} == {
            "linear+dora" if name == "dora" else "conv1d+dora"
        }
        # a Conv1D's column norm is read with a stride: torch's kernel for it is not followed
        compare(load_file(tmp_path / f"{name}.safetensors"), case, exact=EXACT and name == "dora")


def test_patterns_set_each_modules_rank_and_scaling(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    result = ct.merge_lora(cases("patterns").base, cases("patterns").adapter, tmp_path / "m.pt")
    by_key = {m.key: (m.r, m.alpha, m.scaling) for m in result.merged}
    assert by_key["model.layers.1.self_attn.q_proj.weight"] == (2, 8, 4.0)
    assert by_key["model.layers.0.self_attn.q_proj.weight"] == (4, 8, 2.0)
    assert by_key["model.layers.0.self_attn.v_proj.weight"] == (4, 3, 0.75)


def test_embedding_and_modules_to_save(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("embedding")
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert result.replaced == ("lm_head.weight",)
    assert "model.embed_tokens.weight" in {m.key for m in result.merged}
    assert not torch.equal(case.merged["lm_head.weight"], case.base_sd["lm_head.weight"])


def test_wrapped_base_keeps_its_keys(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("ddp")
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    out = torch.load(tmp_path / "m.pt")
    assert all(k.startswith("module.") for k in out)
    compare({k.removeprefix("module."): v for k, v in out.items()}, case)


def test_sharded_hf_base(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("sharded")
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    assert result.input_format == "hf-sharded"
    out = load_file(tmp_path / "m.safetensors")
    # save_pretrained drops the tied lm_head, as the index does; every other tensor is here.
    compare(out, case._replace(base_sd={k: case.base_sd[k] for k in out}))


def test_a_base_whose_keys_all_start_with_model_is_not_unwrapped(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("tied")
    saved = load_file(case.base / "model.safetensors")
    assert "lm_head.weight" not in saved and all(k.startswith("model.") for k in saved)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    assert {m.key for m in result.merged} == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    }
    out = load_file(tmp_path / "m.safetensors")
    compare(out, case._replace(base_sd={k: case.base_sd[k] for k in out}))
    # The same tensors under DDP's "module.": that wrapper alone is stripped.
    torch.save({f"module.{k}": v for k, v in saved.items()}, tmp_path / "ddp.pt")
    ct.merge_lora(tmp_path / "ddp.pt", case.adapter, tmp_path / "m.pt")
    wrapped = torch.load(tmp_path / "m.pt")
    assert list(wrapped) == [f"module.{k}" for k in saved]
    compare(
        {k.removeprefix("module."): v for k, v in wrapped.items()},
        case._replace(base_sd={k: case.base_sd[k] for k in saved}),
    )


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_saved_module_tied_to_another_is_untied_as_peft_unties_it(
    cases: Callable[[str], Case], tmp_path: Path, suffix: str
) -> None:
    case = cases("tied-saved-head")
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    base = torch.load(case.base)
    assert base[head].untyped_storage().data_ptr() == base[embed].untyped_storage().data_ptr()
    result = ct.merge_lora(case.base, case.adapter, tmp_path / f"m{suffix}")
    assert result.replaced == (head,)
    out = (
        torch.load(tmp_path / f"m{suffix}")
        if suffix == ".pt"
        else load_file(tmp_path / f"m{suffix}")
    )
    assert torch.equal(out[embed], base[embed]) and not torch.equal(out[head], base[head])
    compare(out, case)


@pytest.mark.parametrize(("name", "suffix"), [("linear", ".pt"), ("embedding", ".safetensors")])
def test_dtype_casts_after_merging(
    cases: Callable[[str], Case], tmp_path: Path, name: str, suffix: str
) -> None:
    # "embedding" also replaces lm_head by its modules_to_save copy, cast as it is copied.
    case = cases(name)
    out_path = tmp_path / f"m{suffix}"
    ct.merge_lora(case.base, case.adapter, out_path, dtype="bf16")
    out = torch.load(out_path) if suffix == ".pt" else load_file(out_path)
    assert sorted(out) == sorted(case.merged)
    for key, want in case.merged.items():
        assert close(out[key], want.to(torch.bfloat16)), key


def test_dtype_takes_slim_s_spellings_on_the_command_line(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("linear")
    run_ckpt("merge-lora", case.base, case.adapter, tmp_path / "m.pt", "--dtype", "half")
    out = torch.load(tmp_path / "m.pt")
    for key, want in case.merged.items():
        assert out[key].dtype == torch.float16 and close(out[key], want.half()), key


def test_dry_run_lists_each_merge_and_writes_nothing(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("rslora")
    _, out, _ = run_ckpt("merge-lora", case.base, case.adapter, tmp_path / "m.pt", "--dry-run")
    assert "merge linear" in out and "r=4 alpha=8 scaling=4" in out
    assert not (tmp_path / "m.pt").exists()
    _, out, _ = run_ckpt("merge-lora", case.base, case.adapter, tmp_path / "m.pt", "--json")
    data = json.loads(out)
    assert {m["scaling"] for m in data["merged"]} == {4.0} and len(data["merged"]) == 4
    compare(torch.load(tmp_path / "m.pt"), case)


def test_lora_bias_changes_the_bias(cases: Callable[[str], Case], tmp_path: Path) -> None:
    case = cases("lora-bias")
    key = "transformer.h.0.attn.c_attn.bias"
    assert not torch.equal(case.merged[key], case.base_sd[key])  # the oracle merged a bias
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert {r.key: r.action for r in result.rows}[key].startswith("merge lora bias")
    assert close(torch.load(tmp_path / "m.pt")[key], case.merged[key])


@pytest.mark.parametrize("name", ["linear", "conv1d", "embedding", "dora", "dora-conv1d", "bf16"])
def test_blocks_of_rows_change_nothing(
    cases: Callable[[str], Case], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    case = cases(name)
    ct.merge_lora(case.base, case.adapter, tmp_path / "whole.pt")
    # 40 elements: a block of one row or a few, and a last block shorter than the others
    monkeypatch.setattr("ckpt_tools.ops.merge.records._BLOCK", 40)
    monkeypatch.setattr("ckpt_tools.ops.merge.arithmetic._TILE", 24)  # matmul tiles too
    ct.merge_lora(case.base, case.adapter, tmp_path / "blocks.pt")
    whole, blocks = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "blocks.pt")
    for key, t in whole.items():
        assert torch.equal(t.view(torch.uint8), blocks[key].view(torch.uint8)), key


def test_a_folder_output_loads_in_transformers(
    cases: Callable[[str], Case], tmp_path: Path
) -> None:
    case = cases("sharded")
    out = tmp_path / "merged-hf"
    _, text, _ = run_ckpt(
        "merge-lora", case.base, case.adapter, f"{out}/", "--max-shard-size", "30KB"
    )
    assert (out / "model.safetensors.index.json").is_file() and "merge-lora: wrote" in text
    shutil.copyfile(case.base / "config.json", out / "config.json")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    compare(loaded, case)


def test_entries_under_keys_that_are_not_strings_are_kept(tmp_path: Path) -> None:
    # torch.load gives them back; no adapter names them, so they are copied as they are.
    torch.manual_seed(0)
    base = {"fc.weight": torch.randn(6, 4), 7: torch.ones(3), "fc.bias": torch.randn(6), 2.5: 1}
    torch.save(base, tmp_path / "base.pt")
    (tmp_path / "lora").mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["fc"]}
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(config))
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    parts = {"base_model.model.fc.lora_A.weight": a, "base_model.model.fc.lora_B.weight": b}
    torch.save(parts, tmp_path / "lora" / "adapter_model.bin")
    result = ct.merge_lora(tmp_path / "base.pt", tmp_path / "lora", tmp_path / "m.pt")
    out = torch.load(tmp_path / "m.pt", weights_only=True)
    assert list(out) == list(base) and result.dropped == ()
    assert torch.equal(out[7], base[7]) and out[2.5] == 1
    assert torch.equal(out["fc.bias"], base["fc.bias"])
    assert torch.allclose(out["fc.weight"], base["fc.weight"] + b @ a * 2.0)
    # safetensors names tensors by strings: refused before writing, as convert refuses it.
    for dst in ("m.safetensors", "hf/"):  # a file, and a folder of shards
        with pytest.raises(ct.ConversionError, match=r"tensor\(s\) under other keys: 7"):
            ct.merge_lora(tmp_path / "base.pt", tmp_path / "lora", f"{tmp_path}/{dst}")
        assert not (tmp_path / dst).exists()
