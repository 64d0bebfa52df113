"""``inspect`` on files saved here by torch: memory shared through a sparse or quantized
tensor's parts, the storages a per-channel quantized tensor holds, dtype values, folded rows
of tied tensors, and a Hugging Face folder whose keys all lie under ``model.``.

Oracles: ``torch.load`` (``data_ptr`` and the file's storage records) and transformers'
``from_pretrained``.
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.structure.text import human_bytes


def _records(path: Path) -> int:
    """The bytes of the storage records torch wrote."""
    with zipfile.ZipFile(path) as z:
        return sum(
            i.file_size
            for i in z.infolist()
            if "/data/" in i.filename and not i.filename.endswith("serialization_id")
        )


def test_a_sparse_tensor_shares_its_values_with_an_entry(tmp_path: Path) -> None:
    vals = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        coo = torch.sparse_coo_tensor(torch.tensor([[0, 1, 2]]), vals, (5,))
    path = tmp_path / "sparse_shared.pt"
    torch.save({"coo": coo, "vals": vals, "other": torch.ones(2)}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["coo"]._values().data_ptr() == loaded["vals"].data_ptr()
    info = ckpt_tools.inspect(path)
    assert info.tensor("coo").shared_with == ("vals",)
    assert info.tensor("vals").shared_with == ("coo",)
    assert info.tensor("other").shared_with == ()
    assert info.storage_bytes == _records(path)


def test_per_channel_quantizer_storages_are_counted(tmp_path: Path) -> None:
    scales = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    qc = torch.quantize_per_channel(torch.randn(4, 3), scales, torch.arange(4), 0, torch.quint8)
    path = tmp_path / "qpc.pt"
    torch.save({"qc": qc, "q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)}, path)
    info = ckpt_tools.inspect(path)
    assert info.storage_bytes == _records(path) == 12 + 32 + 32 + 3
    assert info.tensor("qc").nbytes == qc.int_repr().nbytes


def test_a_scales_tensor_saved_beside_is_shared(tmp_path: Path) -> None:
    qc = torch.quantize_per_channel(
        torch.randn(2, 3),
        torch.tensor([0.1, 0.2], dtype=torch.float64),
        torch.zeros(2),
        0,
        torch.qint8,
    )
    scales = qc.q_per_channel_scales()
    path = tmp_path / "qpc_shared.pt"
    torch.save({"qc": qc, "scales": scales}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["qc"].q_per_channel_scales().data_ptr() == loaded["scales"].data_ptr()
    info = ckpt_tools.inspect(path)
    assert info.tensor("scales").shared_with == ("qc",)
    assert info.storage_bytes == _records(path)


def test_dtype_values_show_as_torch_shows_them(tmp_path: Path) -> None:
    path = tmp_path / "dtype_entry.pt"
    obj = {"model": {"w": torch.ones(2)}, "dtype": torch.bfloat16, "half": torch.float16}
    torch.save(obj, path)
    loaded = torch.load(path, weights_only=True)
    info = ckpt_tools.inspect(path)
    assert info.entries["dtype"] == repr(loaded["dtype"]) == "torch.bfloat16"
    assert info.entries["half"] == repr(loaded["half"])
    assert info.to_json()["entries"]["dtype"] == "torch.bfloat16"
    assert "  dtype: torch.bfloat16" in info.text()


def test_folded_tied_rows_say_they_share(tmp_path: Path) -> None:
    w = torch.zeros(3, 3)
    path = tmp_path / "grp_tied.pt"
    torch.save(
        {
            "tied.0.w": w,
            "tied.1.w": w,
            "own.0.w": torch.ones(2),
            "own.1.w": torch.ones(2),
            "head.w": w,
        },
        path,
    )
    loaded = torch.load(path, weights_only=True)
    assert loaded["tied.0.w"].data_ptr() == loaded["tied.1.w"].data_ptr()
    rows = {row[0]: row for row in ckpt_tools.inspect(path).rows(group=True)}
    assert rows["tied.{0..1}.w ×2"][4] != ""  # one storage
    assert rows["tied.{0..1}.w ×2"][7] == "each other, head.w"
    assert rows["own.{0..1}.w ×2"][4] == rows["own.{0..1}.w ×2"][7] == ""


def test_a_folded_row_holds_one_layout_and_its_members_bytes(tmp_path: Path) -> None:
    # Sparse tensors of one shape hold other numbers of values, and a dense one of that shape
    # is no repeat of them: the bytes are torch's, summed.
    torch.manual_seed(0)
    one = torch.zeros(100, 100)
    one[0, 0] = 1
    saved = {
        "layers.0.w": one.to_sparse(),
        "layers.1.w": torch.randn(100, 100).to_sparse(),
        "layers.2.w": torch.randn(100, 100),
    }
    torch.save(saved, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    size = {k: v._indices().nbytes + v._values().nbytes if v.is_sparse else v.nbytes
            for k, v in loaded.items()}  # fmt: skip
    rows = {row[0]: row for row in ckpt_tools.inspect(tmp_path / "m.pt").rows(group=True)}
    assert sorted(rows) == ["layers.2.w", "layers.{0..1}.w ×2"]
    sparse, dense = rows["layers.{0..1}.w ×2"], rows["layers.2.w"]
    assert sparse[1] == "float32 (sparse_coo)" and dense[1] == "float32"
    assert sparse[6] == human_bytes(size["layers.0.w"] + size["layers.1.w"])
    assert dense[6] == human_bytes(size["layers.2.w"])


def test_hf_folder_with_every_key_under_model_reports_no_wrapper(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    folder = tmp_path / "llama_tied"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
        _, loading = transformers.LlamaForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]
    for path in (folder, folder / "model.safetensors"):
        info = ckpt_tools.inspect(path)
        assert all(t.name.startswith("model.") for t in info.tensors)
        assert info.wrappers == (), path
        assert "wrappers:    none" in info.text()


def test_a_lightning_checkpoint_still_reports_model(tmp_path: Path) -> None:
    sd = {f"model.{k}": v for k, v in torch.nn.Linear(2, 2).state_dict().items()}
    path = tmp_path / "l.ckpt"
    torch.save({"state_dict": sd, "pytorch-lightning_version": "2.0", "epoch": 1}, path)
    assert [w.prefix for w in ckpt_tools.inspect(path).wrappers] == ["model."]


def test_a_layout_value_is_shown_as_torch_names_it(tmp_path: Path) -> None:
    path = tmp_path / "values.pt"
    torch.save({"w": torch.ones(2), "layout": torch.sparse_csr, "plain": torch.strided}, path)
    loaded = torch.load(path, weights_only=True)
    entries = ckpt_tools.inspect(str(path)).entries
    assert entries["layout"] == str(loaded["layout"]) == "torch.sparse_csr"
    assert entries["plain"] == str(loaded["plain"])
