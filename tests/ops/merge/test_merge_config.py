"""merge-lora follows adapter_config.json as PEFT reads it: malformed values refused by name,
a config that disagrees with the weight file refused, and ``modules_to_save`` matched as PEFT
matches it (parents and plain-text suffixes), each merge checked against PEFT's."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckpt_tools as ct
from ckpt_tools.errors import ConversionError, CorruptCheckpointError
from tests.helpers import run_ckpt
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, tiny_gpt2, tiny_llama
from tests.ops.merge.test_merge_lora import close, compare, make_case

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")
transformers = ImportedWhenUsed("transformers")


def _lora(*names: str, **kwargs: Any) -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(names), **kwargs)


def _edit(adapter: Path, **fields: Any) -> None:
    path = adapter / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 4)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An MLP's base and an adapter of fc1 and fc2, both saved by PEFT."""
    return make_case(tmp_path_factory.mktemp("mlp") / "case", _Mlp, _lora("fc1", "fc2"))


def _copy(mlp: Any, tmp_path: Path) -> Path:
    adapter = tmp_path / "adapter"
    for f in mlp.adapter.iterdir():
        (adapter / f.name).parent.mkdir(exist_ok=True)
        (adapter / f.name).write_bytes(f.read_bytes())
    return adapter


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"r": 0}, "r is 0"),
        ({"r": "4"}, "r is '4'"),
        ({"r": True}, "r is True"),
        ({"lora_alpha": "8"}, "lora_alpha is '8'"),
        ({"rank_pattern": ["fc1"]}, "rank_pattern is"),
        ({"rank_pattern": {"fc1": 0}}, "rank_pattern['fc1']"),
        ({"alpha_pattern": {"fc1": "2"}}, "alpha_pattern['fc1']"),
        ({"rank_pattern": {"fc(": 4}}, "rank_pattern key 'fc('"),
        ({"target_modules": 5}, "target_modules is 5, not a module name"),
        ({"exclude_modules": [7]}, "exclude_modules is [7], not a module name"),
        ({"modules_to_save": 3}, "modules_to_save is 3, not a list of module names"),
        ({"modules_to_save": "fc1"}, "modules_to_save is 'fc1', not a list of module names"),
        ({"layers_to_transform": "0"}, "layers_to_transform is '0', not a layer index"),
        ({"layers_pattern": {"a": 1}}, "layers_pattern is {'a': 1}, not a module name"),
    ],
)
def test_malformed_config_values_are_refused_by_name(
    mlp: Any, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    adapter = _copy(mlp, tmp_path)
    _edit(adapter, **fields)
    with pytest.raises(CorruptCheckpointError, match=named.replace("[", r"\[").replace("(", r"\(")):
        ct.merge_lora(mlp.base, adapter, tmp_path / "m.pt")
    code, stdout, stderr = run_ckpt("merge-lora", mlp.base, adapter, tmp_path / "m.pt", code=None)
    assert code == 4 and stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
    assert "Traceback" not in stderr and not (tmp_path / "m.pt").exists()
    code, _, stderr = run_ckpt("inspect", adapter, code=None)
    assert code == 4 and "Traceback" not in stderr and named.split(" ")[0] in stderr


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"target_modules": ["fc1"]}, "fc2"),
        ({"exclude_modules": ["fc2"]}, "fc2"),
        ({"target_modules": "fc1"}, "fc2"),
        ({"use_dora": True}, "use_dora=True"),
        # A rank the weights do not have is said as one (PEFT's load: a size mismatch).
        ({"r": 2}, "the weights have rank 4 .*config gives rank 2"),
        ({"rank_pattern": {"fc1": 8}}, "'fc1': the weights have rank 4 .*config gives rank 8"),
    ],
)
def test_a_config_that_disagrees_with_the_weights_is_refused(
    mlp: Any, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    adapter = _copy(mlp, tmp_path)
    _edit(adapter, **fields)
    with pytest.raises(ConversionError, match=named):
        ct.merge_lora(mlp.base, adapter, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def test_dora_weights_under_a_plain_config_are_refused(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", _Mlp, _lora("fc1", use_dora=True))
    _edit(case.adapter, use_dora=False)
    with pytest.raises(ConversionError, match="use_dora=False"):
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")


def test_layers_to_transform_leaving_a_module_out_is_refused(tmp_path: Path) -> None:
    case = make_case(tmp_path / "case", tiny_llama, _lora("q_proj"))
    _edit(case.adapter, layers_to_transform=[1])
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.q_proj"):
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    _edit(case.adapter, layers_to_transform=[0, 1])  # agreeing, it merges as PEFT does
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    compare(torch.load(tmp_path / "m.pt"), case)


def _hf(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder / "base-hf")
    return folder / "base-hf"


def test_a_trained_copy_of_the_embedding_a_tied_head_merges_into_is_refused(
    tmp_path: Path,
) -> None:
    case = make_case(
        tmp_path / "case",
        lambda: tiny_llama(1, tie_word_embeddings=True),
        _lora("lm_head", modules_to_save=["embed_tokens"]),
        save=_hf,
    )
    # PEFT gives the head the embedding plus its delta, apart from the trained copy.
    assert not torch.equal(case.merged["lm_head.weight"], case.merged["model.embed_tokens.weight"])
    with pytest.raises(ConversionError, match="lm_head") as err:
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    assert "tie_word_embeddings" in str(err.value) and "--" not in str(err.value)
    assert not (tmp_path / "m.safetensors").exists()


def test_a_trained_copy_of_the_embedding_a_left_out_head_is_tied_to_is_refused(
    tmp_path: Path,
) -> None:
    # New tokens trained on a tied model (Llama 3.2 1B): PEFT swaps in the trained copy and
    # the head keeps the base's embedding, which a folder tied by config.json cannot hold.
    case = make_case(
        tmp_path / "case",
        lambda: tiny_llama(1, tie_word_embeddings=True),
        _lora("q_proj", modules_to_save=["embed_tokens"]),
        save=_hf,
    )
    assert not torch.equal(case.merged["lm_head.weight"], case.merged["model.embed_tokens.weight"])
    with pytest.raises(ConversionError, match="ensure_weight_tying=True") as err:
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    said = str(err.value)
    assert "model.embed_tokens.weight" in said and "LlamaForCausalLM" in said, said
    assert not (tmp_path / "m.safetensors").exists()
    # A model without a head (its architecture a bare LlamaModel) has nothing tied to it.
    config = json.loads((case.base / "config.json").read_text())
    (case.base / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaModel"]}))
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    out = load_file(tmp_path / "m.safetensors")
    assert torch.equal(out["model.embed_tokens.weight"], case.merged["model.embed_tokens.weight"])


def test_a_part_of_a_composite_model_ties_no_head_by_its_own_architectures() -> None:
    # An EncoderDecoderModel's encoder config keeps "BertForMaskedLM" from the checkpoint it
    # was built from, but inside the composite it is a BertModel: no head is tied to it.
    from ckpt_tools.ops.merge.layout import tied_head

    bert = {"model_type": "bert", "architectures": ["BertForMaskedLM"]}
    composite = {"model_type": "encoder-decoder", "encoder": bert, "decoder": bert}
    assert tied_head("encoder.embeddings.word_embeddings.weight", composite) is None
    assert tied_head("embeddings.word_embeddings.weight", bert) == "BertForMaskedLM"
    assert (
        tied_head("embeddings.word_embeddings.weight", {**bert, "tie_word_embeddings": False})
        is None
    )


def _tied_state_dict(model: Any, folder: Path) -> Path:
    torch.save(model.state_dict(), folder / "base.pt")  # both names, one storage
    return folder / "base.pt"


@pytest.mark.parametrize(
    ("target", "saved"), [("lm_head", "embed_tokens"), ("embed_tokens", "lm_head")]
)
def test_a_trained_copy_of_one_tied_weight_saved_under_both_names_is_untied(
    tmp_path: Path, target: str, saved: str
) -> None:
    # Both names are in the base: the copy gets its own weight, the other keeps the merge.
    case = make_case(
        tmp_path / "case",
        lambda: tiny_llama(1, tie_word_embeddings=True),
        _lora(target, modules_to_save=[saved]),
        save=_tied_state_dict,
    )
    base = torch.load(case.base)
    head, embed = base["lm_head.weight"], base["model.embed_tokens.weight"]
    assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    compare(torch.load(tmp_path / "m.pt"), case)


def test_a_saved_head_left_out_of_a_tied_base_is_refused_with_the_fix(tmp_path: Path) -> None:
    case = make_case(
        tmp_path / "case",
        lambda: tiny_llama(1, tie_word_embeddings=True),
        _lora("q_proj", modules_to_save=["lm_head"]),
        save=_hf,
    )
    with pytest.raises(ConversionError, match=r"lm_head\.weight .*tie_word_embeddings false"):
        ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")


def _roberta() -> Any:
    config = transformers.RobertaConfig(
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=24,
        num_attention_heads=2,
        vocab_size=40,
        num_labels=3,
    )
    return transformers.RobertaForSequenceClassification(config)


@pytest.mark.parametrize(
    ("build", "config", "saved"),
    [
        # SEQ_CLS adds modules_to_save=["classifier", "score"]: RoBERTa's is a parent module.
        (_roberta, _lora("query", "value", task_type="SEQ_CLS"), "classifier.dense.weight"),
        # bias="all" also saves the wrapped parent's original_module biases: PEFT drops them.
        (
            _roberta,
            _lora("query", "value", task_type="SEQ_CLS", bias="all"),
            "classifier.out_proj.weight",
        ),
        # PEFT matches by plain suffix: "norm" wraps input_layernorm, "head" wraps lm_head.
        (lambda: tiny_llama(1), _lora("q_proj", modules_to_save=["norm"]), "input_layernorm"),
        (_Mlp, _lora("fc1", modules_to_save=["head"]), "lm_head.weight"),
        (
            lambda: tiny_llama(1, tie_word_embeddings=True),
            _lora("q_proj", modules_to_save=["embed_tokens"], ensure_weight_tying=True),
            "lm_head.weight",
        ),
    ],
)
def test_modules_to_save_are_matched_as_peft_matches_them(
    tmp_path: Path, build: Any, config: Any, saved: str
) -> None:
    case = make_case(tmp_path / "case", build, config)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    assert any(saved in key for key in result.replaced), result.replaced
    compare(torch.load(tmp_path / "m.pt"), case)


@pytest.mark.parametrize(
    ("first", "second", "merged"),
    [
        ({}, {"bias": "lora_only"}, "second"),
        # bias="all" saves the other adapter's wrapper bias (lm_head.original_module.bias),
        # which a model without that adapter loads nowhere.
        ({"bias": "all"}, {"modules_to_save": ["lm_head"]}, "default"),
    ],
    ids=["its-trained-bias", "its-saved-module-s-bias"],
)
def test_another_adapter_s_bias_is_ignored_as_peft_ignores_it(
    tmp_path: Path, first: dict[str, Any], second: dict[str, Any], merged: str
) -> None:
    torch.manual_seed(0)
    base = _Mlp()
    torch.save(base.state_dict(), tmp_path / "base.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), _lora("fc1", **first))
        model.add_adapter("second", _lora("fc2", **second))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name or "bias" in name:
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(tmp_path / "adapter")
        adapter = tmp_path / "adapter" / ("second" if merged == "second" else "")
        loaded = peft.PeftModel.from_pretrained(base, adapter, adapter_name=merged)
        want = loaded.merge_and_unload().state_dict()
    ct.merge_lora(tmp_path / "base.pt", adapter, tmp_path / "m.pt")
    out = torch.load(tmp_path / "m.pt")
    assert sorted(out) == sorted(want)
    assert all(close(out[k], want[k]) for k in want)  # bitwise where torch's kernels are AVX2


def _hf_without_the_tie_key(model: Any, folder: Path) -> Path:
    # As transformers writes GPT-2's config.json: tie_word_embeddings left out (its default).
    base = _hf(model, folder)
    config = json.loads((base / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (base / "config.json").write_text(json.dumps(config))
    return base


def test_a_head_tied_by_default_merges_into_the_embedding(tmp_path: Path) -> None:
    case = make_case(
        tmp_path / "case",
        lambda: tiny_gpt2(1),
        _lora("lm_head", "c_attn", fan_in_fan_out=True),
        save=_hf_without_the_tie_key,
    )
    assert "tie_word_embeddings" not in json.loads((case.base / "config.json").read_text())
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    out = load_file(tmp_path / "m.safetensors")  # the tied head left out, as saved
    assert sorted(out) == sorted(k for k in case.base_sd if k != "lm_head.weight")
    assert all(close(v, case.merged.get(k, case.base_sd[k])) for k, v in out.items())
    assert close(out["transformer.wte.weight"], case.merged["lm_head.weight"])


def _task_model(kind: str) -> Any:
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16, num_labels=3
    )
    config.pad_token_id = 0
    return getattr(transformers, f"GPT2For{kind}")(config)


@pytest.mark.parametrize(
    ("task", "kind", "head"),
    [
        ("SEQ_CLS", "SequenceClassification", "score"),
        ("TOKEN_CLS", "TokenClassification", "classifier"),
        ("QUESTION_ANS", "QuestionAnswering", "qa_outputs"),
    ],
)
def test_a_task_adapters_head_is_a_module_to_save_as_peft_adds_it(
    tmp_path: Path, task: str, kind: str, head: str
) -> None:
    # PEFT's model for the task adds its head to modules_to_save when it loads the adapter;
    # older PEFT saved such adapters with modules_to_save null.
    config = _lora("c_attn", task_type=task, fan_in_fan_out=True)
    case = make_case(tmp_path / "case", lambda: _task_model(kind), config)
    _edit(case.adapter, modules_to_save=None)
    assert any(k.startswith(f"{head}.") for k in case.merged)
    assert not torch.equal(case.merged[f"{head}.weight"], case.base_sd[f"{head}.weight"])
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "merged.safetensors")
    assert f"{head}.weight" in result.replaced
    compare(load_file(tmp_path / "merged.safetensors"), case)
    info = ct.inspect(case.adapter).format_info
    assert head in info.modules_to_save


def test_a_dry_run_into_a_folder_plans_what_the_real_run_writes(mlp: Any, tmp_path: Path) -> None:
    # Its shards and its index, and the folder's format: as convert's and reshard's do.
    out = tmp_path / "merged"
    dry = ct.merge_lora(mlp.base, mlp.adapter, out, max_shard_size=256, dry_run=True)
    real = ct.merge_lora(mlp.base, mlp.adapter, out, max_shard_size=256)
    assert [f.name for f in dry.planned] == list(real.written)
    assert any(name.endswith("model.safetensors.index.json") for name in real.written)
    assert dry.output_format == real.output_format == "hf-sharded"


def test_an_infinite_alpha_is_strict_json_from_the_library_too(mlp: Any, tmp_path: Path) -> None:
    adapter = _copy(mlp, tmp_path)
    _edit(adapter, lora_alpha=float("inf"))  # json.dumps writes Infinity, which PEFT reads
    info = ct.inspect(adapter).to_json()
    assert info["format_info"]["alpha"] == "inf"
    plan = ct.merge_lora(mlp.base, adapter, tmp_path / "m.safetensors", dry_run=True).to_json()
    json.dumps([info, plan], allow_nan=False)  # what --json prints, no Infinity literal


@pytest.mark.parametrize(
    ("dtype", "spelled"),
    [(torch.bfloat16, "mica"), (torch.float16, "mica"), (torch.bfloat16, "MiCA")],
)
def test_a_mica_adapter_on_a_16_bit_base_is_merged_as_peft_merges_it(
    tmp_path: Path, dtype: torch.dtype, spelled: str
) -> None:
    # PEFT's MiCA variant adds delta.to(weight.dtype): the delta is rounded first, then the
    # sum; merged as plain LoRA (one rounding of the sum) a third of the values differed.
    # PEFT picks the variant by the exact spelling: "MiCA" initialises as MiCA, merges as LoRA.
    case = make_case(
        tmp_path / "case", tiny_llama, _lora("q_proj", init_lora_weights=spelled), dtype=dtype,
        autocast=False,
    )  # fmt: skip
    ct.merge_lora(case.base, case.adapter, tmp_path / "m.pt")
    compare(torch.load(tmp_path / "m.pt", weights_only=True), case)


def _t5() -> Any:
    config = transformers.T5Config(
        vocab_size=60, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2
    )
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> Any:
    config = transformers.BartConfig(
        vocab_size=60,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
    )
    return transformers.BartForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("build", "shared", "targets"),
    [
        (_t5, "shared.weight", ["embed_tokens"]),
        (_t5, "shared.weight", ["embed_tokens", "lm_head", "q"]),
        (_bart, "model.shared.weight", ["embed_tokens", "q_proj"]),
    ],
    ids=["t5", "t5-head", "bart"],
)
def test_encoder_and_decoder_embeddings_left_out_merge_into_the_one_they_are_tied_to(
    tmp_path: Path, build: Any, shared: str, targets: list[str]
) -> None:
    # save_pretrained keeps only the shared embedding; PEFT merges the encoder's delta,
    # then the decoder's (then the head's) into it, in the model's order of modules.
    case = make_case(tmp_path / "case", build, _lora(*targets), save=_hf)
    stored = set(load_file(case.base / "model.safetensors"))
    assert shared in stored and not any("embed_tokens" in k for k in stored)
    result = ct.merge_lora(case.base, case.adapter, tmp_path / "m.safetensors")
    out = load_file(tmp_path / "m.safetensors")
    assert set(out) == stored
    merged_into = [m.module.removeprefix("model.") for m in result.merged if m.key == shared]
    order = ["encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]
    assert merged_into == order[: 2 + ("lm_head" in targets)]
    assert all(close(v, case.merged.get(k, case.base_sd[k])) for k, v in out.items())
    assert not torch.equal(out[shared], case.base_sd[shared])
