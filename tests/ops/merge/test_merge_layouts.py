"""Where merge_lora merges each target, against PEFT: square GPT-2 ``Conv1D`` weights beside
Linear ones, targets sharing one tied weight, a tied head an HF folder leaves out, DoRA on an
embedding; and the LoRA variants PEFT does not merge as LoRA, refused by name."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, tiny_llama
from tests.ops.merge.test_merge_lora import compare, make_case

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")
transformers = ImportedWhenUsed("transformers")


def _gpt2_untied() -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, tie_word_embeddings=False
    )
    return transformers.GPT2LMHeadModel(config)


def _gpt2_tied() -> Any:
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _llama_tied() -> Any:
    return tiny_llama(1, tie_word_embeddings=True)


def _lora(*names: str, **kwargs: Any) -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(names), **kwargs)


def _hf(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder / "base-hf")
    return folder / "base-hf"


def _tied_pt(model: Any, folder: Path) -> Path:
    torch.save(model.state_dict(), folder / "base.pt")  # lm_head and embed_tokens: one storage
    return folder / "base.pt"


def test_a_square_conv1d_beside_a_linear_is_refused_unless_settled(tmp_path: Path) -> None:
    # PEFT saves fan_in_fan_out=False, lm_head (a Linear) being the last target it injected.
    case = make_case(tmp_path / "pt", _gpt2_untied, _lora("attn.c_proj", "lm_head"))
    assert json.loads((case.adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is False
    with pytest.raises(ConversionError, match=r"transformer\.h\.0\.attn\.c_proj") as err:
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert "fan_in_fan_out=True" in str(err.value) and "--" not in str(err.value)
    assert not (tmp_path / "m.pt").exists()
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt", fan_in_fan_out=True)
    assert {m.kind for m in result.merged} == {"conv1d", "linear"}
    compare(torch.load(tmp_path / "m.pt"), case)
    code, _, _ = run_ckpt(
        "merge-lora", case.base, case.adapter, tmp_path / "cli.pt", "--fan-in-fan-out"
    )
    assert code == 0
    compare(torch.load(tmp_path / "cli.pt"), case)
    # An HF folder's config.json names the model type, which settles it.
    hf = make_case(tmp_path / "hf", _gpt2_untied, _lora("attn.c_proj", "lm_head"), save=_hf)
    ct.merge_lora(hf.base, hf.adapter, tmp_path / "hf.safetensors")
    out = load_file(tmp_path / "hf.safetensors")
    compare(out, hf._replace(base_sd={k: hf.base_sd[k] for k in out}))


def test_two_targets_on_one_tied_weight_both_merge_into_it(tmp_path: Path) -> None:
    case = make_case(
        tmp_path / "case", _llama_tied, _lora("embed_tokens", "lm_head"), save=_tied_pt
    )
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert {(m.key, m.kind) for m in result.merged} == {(embed, "embedding"), (head, "linear")}
    out = torch.load(tmp_path / "m.pt")
    assert out[head].untyped_storage().data_ptr() == out[embed].untyped_storage().data_ptr()
    compare(out, case)
    _, text, _ = run_ckpt("merge-lora", case.base, case.adapter, tmp_path / "d.pt", "--dry-run")
    both = "merge embedding r=4 scaling=2, then linear r=4 scaling=2"
    assert text.count(both) == 2 and not (tmp_path / "d.pt").exists()


def test_a_tied_head_left_out_of_an_hf_folder_merges_into_its_embedding(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", _llama_tied, _lora("lm_head", "q_proj"), save=_hf)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    assert ("lm_head", "model.embed_tokens.weight") in {(m.module, m.key) for m in result.merged}
    out = load_file(tmp_path / "m.safetensors")
    assert "lm_head.weight" not in out  # the tie stays as the base kept it: by config.json
    compare(out, case._replace(base_sd={k: case.base_sd[k] for k in out}))


def _captioner() -> Any:
    """A VisionEncoderDecoderModel (ViT, GPT-2): each part a model of its own type, its
    config under its name; the decoder ties its head, the whole says it does not."""
    transformers = pytest.importorskip("transformers")
    encoder = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
        image_size=8, patch_size=4,
    )  # fmt: skip
    decoder = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16,
        add_cross_attention=True, is_decoder=True,
    )  # fmt: skip
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    return transformers.VisionEncoderDecoderModel(config)


def test_a_composite_models_parts_are_merged_as_their_own_types(tmp_path: Path) -> None:
    # The decoder's square c_proj are Conv1D (it is a GPT-2), and its head is tied to its
    # wte and left out of the folder: as the decoder's config says, not the whole's.
    targets = ("c_attn", "attn.c_proj", "crossattention.c_proj", "lm_head")
    case = make_case(tmp_path / "case", _captioner, _lora(*targets), save=_hf)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    kinds = {m.module: m.kind for m in result.merged}
    assert kinds["decoder.transformer.h.0.attn.c_proj"] == "conv1d"
    assert kinds["decoder.transformer.h.0.crossattention.c_proj"] == "conv1d"
    head = ("decoder.lm_head", "decoder.transformer.wte.weight")
    assert head in {(m.module, m.key) for m in result.merged}
    # (transformers saves the ViT encoder under its checkpoint names: the decoder's compared)
    out = {k: v for k, v in load_file(tmp_path / "m.safetensors").items() if k in case.base_sd}
    assert {f"{m.module}.weight" for m in result.merged} - {head[0] + ".weight"} <= set(out)
    compare(out, case._replace(base_sd={k: case.base_sd[k] for k in out}))


def test_a_missing_head_is_said_to_be_tied_when_its_embedding_is_unclear(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", _llama_tied, _lora("lm_head"), save=_hf)
    saved = load_file(case.base / "model.safetensors")
    torch.save(
        {**saved, "other.embed_tokens.weight": saved["model.embed_tokens.weight"].clone()},
        case.base / "pytorch_model.bin",
    )
    (case.base / "model.safetensors").unlink()
    with pytest.raises(ConversionError, match="tied to the input embeddings"):
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")


def test_dora_on_an_embedding_is_peft_s(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", tiny_llama, _lora("embed_tokens", "q_proj", use_dora=True))
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert "embedding+dora" in {m.kind for m in result.merged}
    # the embedding's norm runs down its columns, read with a stride: within one ulp
    compare(torch.load(tmp_path / "m.pt"), case, exact=False)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_case(tmp_path_factory.mktemp("plain") / "c", tiny_llama, _lora("q_proj"))


@pytest.mark.parametrize(
    ("field", "value", "peft_refuses"),
    [
        ("alora_invocation_tokens", [1, 2], True),
        ("arrow_config", {"top_k": 1}, None),
        ("use_bdlora", {"nblocks": 2}, None),
        ("kasa_config", {"lora_diag_init": 1.0}, None),
        ("layer_replication", [[0, 2], [1, 2]], False),
        ("init_lora_weights", "pissa", False),
    ],
)
def test_variants_peft_does_not_merge_as_lora_are_refused_by_name(
    plain: Any, tmp_path: Path, field: str, value: Any, peft_refuses: bool | None
) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(plain.adapter, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config[field] = value
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    if peft_refuses is not None:  # PEFT refuses the merge, or merges into another model
        model = tiny_llama()
        model.load_state_dict(plain.base_sd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = peft.PeftModel.from_pretrained(model, adapter)
            if peft_refuses:
                with pytest.raises(NotImplementedError):
                    loaded.merge_and_unload()
            else:
                merged = loaded.merge_and_unload().state_dict()
                key = "model.layers.0.self_attn.q_proj.weight"
                assert sorted(merged) != sorted(plain.merged) or not torch.equal(
                    merged[key], plain.merged[key]
                )
    with pytest.raises(ConversionError, match=field):
        ct.merge_lora(plain.base, adapter, tmp_path / "m.pt")


def _hub_gpt2(model: Any, folder: Path) -> Path:
    """GPT-2 as the Hub keeps it: its base model's keys (``h.0.attn.c_attn.weight``), which
    transformers loads under the ``transformer.`` its heads' classes add."""
    from safetensors.torch import save_file

    (folder / "gpt2").mkdir()
    sd = model.state_dict()
    plain = {k.removeprefix("transformer."): v for k, v in sd.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in plain.items()}, str(folder / "gpt2/model.safetensors"))
    model.config.save_pretrained(folder / "gpt2")
    return folder / "gpt2"


def test_a_base_saved_without_its_models_prefix_is_merged_as_transformers_loads_it(
    tmp_path: Path,
) -> None:
    case = make_case(tmp_path / "case", _gpt2_tied, _lora("c_attn"), save=_hub_gpt2)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    assert {m.key for m in result.merged} == {"h.0.attn.c_attn.weight"}
    out = {f"transformer.{k}": v for k, v in load_file(tmp_path / "m.safetensors").items()}
    compare(out, case._replace(base_sd={k: case.base_sd[k] for k in out}))


def test_a_target_missing_from_the_base_is_not_called_a_tied_head(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", _llama_tied, _lora("q_proj"), save=_hf)
    saved = load_file(case.base / "model.safetensors")
    (case.base / "model.safetensors").unlink()
    torch.save(
        {k: v for k, v in saved.items() if "q_proj" not in k}, case.base / "pytorch_model.bin"
    )
    with pytest.raises(ConversionError, match=r"q_proj.weight \(missing from the base\)") as e:
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert "tied" not in str(e.value)


def test_a_saved_head_the_base_lacks_is_added_as_peft_loads_it(tmp_path: Path) -> None:
    # A SEQ_CLS adapter on the language model's base: the model class builds ``score``, PEFT
    # replaces it with the saved copy, so the merge holds the adapter's copy.
    from tests.ops.merge.test_merge_lora import _perturb

    torch.manual_seed(0)
    _gpt2_tied().save_pretrained(tmp_path / "base")
    classify = transformers.GPT2ForSequenceClassification
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = classify.from_pretrained(tmp_path / "base", num_labels=3)
        config = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["c_attn"])
        lora = peft.get_peft_model(model, config)
        _perturb(lora, 1)
        lora.save_pretrained(tmp_path / "adapter")
        fresh = classify.from_pretrained(tmp_path / "base", num_labels=3)
        merged = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").merge_and_unload()
    want = merged.state_dict()
    result = ct.merge_lora(tmp_path / "base", tmp_path / "adapter", tmp_path / "m.safetensors")
    assert "score.weight" in result.replaced
    out = load_file(tmp_path / "m.safetensors")
    assert set(out) == set(want)
    assert [k for k in out if not torch.equal(out[k], want[k])] == []
