"""merge-lora's refusals: one line, its exit code, nothing written; and inputs mutated."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.helpers import FIXTURES, run_ckpt, torch_free_env
from tests.helpers.lora import NEEDS_PEFT, ImportedWhenUsed, save_peft_adapter, write_tiny_adapter

pytestmark = NEEDS_PEFT
peft = ImportedWhenUsed("peft")


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, Path]:
    """TinyNet's state dict and a LoRA adapter of its ``layers.0`` and ``head``."""
    shutil.copyfile(FIXTURES / "plain.pt", tmp_path / "model.pt")
    return tmp_path / "model.pt", write_tiny_adapter(tmp_path / "lora")


def refused(*args: Any, code: int, names: tuple[str, ...]) -> str:
    """Run merge-lora, expect ``code`` and one stderr line naming ``names``; nothing written."""
    out = Path(args[-1])
    _, stdout, stderr = run_ckpt("merge-lora", *args, code=code)
    assert stdout == "" and len(stderr.strip().splitlines()) == 1, stderr
    for name in names:
        assert name in stderr, stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return stderr


def _peft_adapter(folder: Path, config: Any) -> Path:
    """A tiny (one-layer) Llama's adapter of ``config``'s type, saved by PEFT."""
    return save_peft_adapter(folder, config, layers=1)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]), "IA3"),
        (lambda: peft.LoHaConfig(r=2, target_modules=["q_proj"]), "LOHA"),
        (lambda: peft.LoKrConfig(r=2, target_modules=["q_proj"]), "LOKR"),
    ],
)
def test_other_adapter_types_are_refused(tiny: tuple[Path, Path], make: Any, name: str) -> None:
    base, _ = tiny
    adapter = _peft_adapter(base.parent / name, make())
    refused(base, adapter, base.parent / "out.pt", code=7, names=(name,))


def test_prompt_tuning_is_refused(tiny: tuple[Path, Path]) -> None:
    base, _ = tiny
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    adapter = _peft_adapter(base.parent / "prompt", config)
    refused(base, adapter, base.parent / "out.pt", code=7, names=("PROMPT_TUNING",))


def test_a_target_missing_from_the_base_is_named(tiny: tuple[Path, Path]) -> None:
    base, _ = tiny
    adapter = _peft_adapter(base.parent / "llama", peft.LoraConfig(target_modules=["q_proj"]))
    refused(
        base,
        adapter,
        base.parent / "out.pt",
        code=7,
        names=("model.layers.0.self_attn.q_proj.weight", "missing"),
    )


def test_a_shape_that_does_not_fit_is_named(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.layers.0.lora_A.weight"] = np.ones((2, 5), np.float32)
    save_file(tensors, adapter / "adapter_model.safetensors")
    refused(base, adapter, base.parent / "out.pt", code=7, names=("layers.0.weight", "[8, 8]"))


def test_a_pickled_adapter_with_an_unsafe_global_is_refused(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    (adapter / "adapter_model.safetensors").unlink()
    shutil.copyfile(FIXTURES / "evil.pt", adapter / "adapter_model.bin")
    refused(base, adapter, base.parent / "out.pt", code=3, names=("adapter_model.bin",))


def _edit_config(adapter: Path, **changes: Any) -> None:
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "names"),
    [
        ({"r": 4}, ("rank 2", "gives rank 4", "head")),
        ({"trainable_token_indices": [1, 2]}, ("trainable_token_indices",)),
        ({"peft_type": "VERA"}, ("VERA",)),
    ],
)
def test_mutated_configs_are_refused(
    tiny: tuple[Path, Path], changes: dict[str, Any], names: tuple[str, ...]
) -> None:
    base, adapter = tiny
    _edit_config(adapter, **changes)
    refused(base, adapter, base.parent / "out.pt", code=7, names=names)


def test_a_config_that_is_not_json_is_corrupt(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", ')
    refused(base, adapter, base.parent / "out.pt", code=4, names=("adapter_config.json",))


@pytest.mark.parametrize(
    ("drop", "add", "names"),
    [
        ("base_model.model.head.lora_B.weight", None, ("head", "lora_B")),
        (None, "base_model.model.head.lora_C.weight", ("lora_C", "modules_to_save")),
    ],
)
def test_mutated_adapter_tensors_are_refused(
    tiny: tuple[Path, Path], drop: str | None, add: str | None, names: tuple[str, ...]
) -> None:
    base, adapter = tiny
    tensors = load_file(adapter / "adapter_model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = np.zeros((2, 2), np.float32)
    save_file(tensors, adapter / "adapter_model.safetensors")
    refused(base, adapter, base.parent / "out.pt", code=7, names=names)


def test_an_existing_output_needs_force(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    out = base.parent / "out.pt"
    out.write_bytes(b"keep")
    run_ckpt("merge-lora", base, adapter, out, code=6)
    assert out.read_bytes() == b"keep"
    run_ckpt("merge-lora", base, adapter, out, "--force", "--quiet")
    assert out.read_bytes() != b"keep"


def test_the_adapter_is_never_the_output(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    weights = adapter / "adapter_model.safetensors"
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}
    _, _, err = run_ckpt("merge-lora", base, adapter, weights, "--force", code=6)
    assert "adapter_model.safetensors" in err
    # Nor its config (the adapter is an input: --force replaces no file of it), nor the
    # folder itself as a folder output.
    config = adapter / "adapter_config.json"
    run_ckpt("merge-lora", base, adapter, config, "--force", "--format", "torch", code=6)
    _, _, err = run_ckpt("merge-lora", base, adapter, f"{adapter}/", "--force", code=6)
    assert f"output folder '{adapter}/' is the input or holds it ({str(adapter)!r})" in err
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before
    # A new file written into it is fine: PEFT reads only its own names there.
    run_ckpt("merge-lora", base, adapter, adapter / "merged.pt", "-q")
    assert (adapter / "merged.pt").is_file()


@pytest.mark.parametrize("name", ["merged.pt", "merged/"])
def test_an_output_written_into_the_adapter_folder_is_replaced_with_force(
    tiny: tuple[Path, Path], name: str
) -> None:
    base, adapter = tiny
    out = f"{adapter}/{name}"
    run_ckpt("merge-lora", base, adapter, out, "-q")
    _, _, err = run_ckpt("merge-lora", base, adapter, out, "-q", code=6)
    assert "already exists; pass --force" in err
    run_ckpt("merge-lora", base, adapter, out, "-q", "--force")
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", name.rstrip("/")}


def test_a_file_of_the_adapter_is_refused_as_one_before_force_is_offered(
    tiny: tuple[Path, Path],
) -> None:
    base, adapter = tiny
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        _, _, err = run_ckpt(
            "merge-lora", base, adapter, adapter / name, "--format", "torch", code=6
        )
        assert "is a file of the input folder" in err and "--force" not in err, err


def test_a_file_of_the_adapter_reached_through_links_is_refused_too(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    # The folder through a linked folder, and a config that is a link (a hub cache's
    # snapshot links each file to its blob): the file PEFT reads, by either path.
    base, adapter = tiny
    alias = tmp_path / "alias"
    alias.symlink_to(adapter)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for entry in adapter.iterdir():
        (snapshot / entry.name).symlink_to(entry)
    config = (adapter / "adapter_config.json").read_bytes()
    for folder, out in ((alias, alias), (snapshot, snapshot), (snapshot, adapter)):
        target = out / "adapter_config.json"
        _, _, err = run_ckpt("merge-lora", base, folder, target, "--format", "torch", "--force",
                             code=6)  # fmt: skip
        assert "is a file of the input folder" in err, err
    assert (adapter / "adapter_config.json").read_bytes() == config


def test_merging_imports_no_torch(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    env = torch_free_env(base.parent)
    run_ckpt("merge-lora", base, adapter, base.parent / "out.safetensors", how="module", env=env)
    assert (base.parent / "out.safetensors").is_file()


def test_a_magnitude_vector_of_the_wrong_length_is_refused(tiny: tuple[Path, Path]) -> None:
    base, adapter = tiny
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.head.lora_magnitude_vector"] = np.ones(5, np.float32)
    save_file(tensors, adapter / "adapter_model.safetensors")
    refused(
        base, adapter, base.parent / "out.pt", code=7, names=("head.lora_magnitude_vector", "[5]")
    )


def test_layers_peft_adapts_whole_are_refused_by_what_they_are(tmp_path: Path) -> None:
    # PEFT merges both (its MultiheadAttention wraps out_proj; ensure_weight_tying adapts a
    # tied head with the embedding): neither is a target the config leaves out.
    import torch
    from torch import nn

    from tests.helpers.lora import tiny_llama

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2)

    cases = {
        "mha": (Attention, peft.LoraConfig(r=2, target_modules=["attn"]), "inside a layer"),
        "tied": (
            lambda: tiny_llama(1, tie_word_embeddings=True),
            peft.LoraConfig(
                r=2, target_modules=["embed_tokens", "lm_head"], ensure_weight_tying=True
            ),
            "ensure_weight_tying",
        ),
    }
    for name, (make, config, says) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        torch.save(make().state_dict(), folder / "base.pt")
        peft.get_peft_model(make(), config).save_pretrained(folder / "adapter")
        err = run_ckpt(
            "merge-lora", folder / "base.pt", folder / "adapter", folder / "m.pt", code=7
        ).stderr
        assert says in err and "leave out" not in err, err
