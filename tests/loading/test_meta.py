"""load_into on a model built on the meta device: the loaded tensors are assigned, and with
``mmap=True`` they are the memory-mapped file's pages, not anonymous copies.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ckpt_tools import UsageError, load_into, load_with_info
from ckpt_tools.loading.into_module import on_meta


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8))
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.block(self.embed(ids))
        return self.head(self.norm(x.reshape(-1, 8)).reshape(x.shape))


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Tiny, str]:
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.norm.running_mean.uniform_()
        model.norm.num_batches_tracked.fill_(5)
    model.eval()
    path = str(tmp_path / "tiny.pt")
    torch.save({"state_dict": model.state_dict(), "epoch": 1}, path)
    return model, path


def _mapped_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process where ``path`` is mapped (from /proc/self/maps)."""
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def _inside(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    ptr = tensor.untyped_storage().data_ptr()
    return any(
        start <= ptr and ptr + tensor.untyped_storage().nbytes() <= end for start, end in ranges
    )


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")


def _meta_tiny() -> Tiny:
    with torch.device("meta"):
        return Tiny().eval()


def test_a_meta_model_is_assigned_the_checkpoint_and_computes_as_the_original(
    trained: tuple[Tiny, str],
) -> None:
    model, path = trained
    meta = _meta_tiny()
    assert on_meta(meta) and not on_meta(model)
    report = load_into(meta, path)
    assert report.assigned and report.ok and report.loaded == len(model.state_dict())
    assert not on_meta(meta)
    for (name, ours), (_, theirs) in zip(meta.state_dict().items(), model.state_dict().items()):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    assert all(isinstance(p, nn.Parameter) for p in meta.parameters())
    ids = torch.tensor([[1, 2, 3, 15]])
    with torch.no_grad():
        assert torch.equal(meta(ids), model(ids))
    # Tied in the file (one storage): the two parameters share memory again.
    assert meta.head.weight.data_ptr() == meta.embed.weight.data_ptr()
    assert "assigned" in str(report) and report.to_json()["assigned"] is True


@needs_proc
def test_assigned_tensors_are_the_mapped_file_not_copies(trained: tuple[Tiny, str]) -> None:
    _, path = trained
    meta = _meta_tiny()
    load_into(meta, path, mmap=True)
    ranges = _mapped_ranges(path)
    assert ranges, "the checkpoint is not mapped"
    tensors = dict(meta.state_dict())
    assert tensors and all(_inside(t, ranges) for t in tensors.values())
    # Not so for a legacy file (read with pread, as torch reads it): the check can fail.
    legacy = path.replace(".pt", "_legacy.pt")
    torch.save(torch.load(path), legacy, _use_new_zipfile_serialization=False)
    meta = _meta_tiny()
    load_into(meta, legacy, mmap=True)
    assert not _mapped_ranges(legacy)


@needs_proc
def test_a_safetensors_file_is_assigned_mapped_too(
    trained: tuple[Tiny, str], tmp_path: Path
) -> None:
    model, _ = trained
    path = str(tmp_path / "tiny.safetensors")
    sd = model.state_dict()
    sd.pop("head.weight")  # safetensors refuses shared tensors: the tie is the model's
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    meta = _meta_tiny()
    report = load_into(meta, path, strict=False, mmap=True)
    assert report.assigned and report.missing == ("head.weight",)
    ranges = _mapped_ranges(path)
    assert all(_inside(getattr(meta.block[0], n), ranges) for n in ("weight", "bias"))
    assert torch.equal(meta.block[0].weight, model.block[0].weight)


def test_explicit_assign_overrides_the_automatic_choice(trained: tuple[Tiny, str]) -> None:
    model, path = trained
    meta = _meta_tiny()
    # A copy into meta tensors (torch's no-op, with a warning) is refused: nothing moves.
    with pytest.raises(UsageError, match="on the meta device"):
        load_into(meta, path, assign=False)
    assert on_meta(meta)
    # A real model assigned: its parameters become the checkpoint's, dtype included.
    half = path.replace(".pt", "_half.pt")
    torch.save(
        {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}, half
    )
    target = Tiny()
    report = load_into(target, half, assign=True)
    assert report.assigned and report.dtype_casts == ()
    assert target.block[0].weight.dtype == torch.float16
    assert isinstance(target.block[0].weight, nn.Parameter)
    copied = Tiny()
    report = load_into(copied, half)
    assert not report.assigned and copied.block[0].weight.dtype == torch.float32
    assert report.dtype_casts


def test_the_state_dict_behind_assign_is_plain_load_state_dict(trained: tuple[Tiny, str]) -> None:
    _, path = trained
    sd, info = load_with_info(path, mmap=True)
    assert info.mmap and not isinstance(sd["block.0.weight"], nn.Parameter)
    meta = _meta_tiny()
    meta.load_state_dict(sd, assign=True)
    assert meta.block[0].weight.data_ptr() == sd["block.0.weight"].data_ptr()


class WithRotary(nn.Module):
    """A linear layer and a buffer no state dict holds (as a rotary embedding's inv_freq)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_what_no_state_dict_holds_is_reported_left_on_meta(tmp_path: Path) -> None:
    path = tmp_path / "rotary.pt"
    torch.save(WithRotary().state_dict(), path)
    with torch.device("meta"):
        model = WithRotary()
    report = load_into(model, path)
    # torch's assign leaves the buffer on meta too; the report says so.
    assert report.assigned and report.ok and report.left_on_meta == ("inv_freq",)
    assert model.inv_freq.is_meta and not model.proj.weight.is_meta
    assert "still on meta (1): inv_freq" in report.text()
    assert report.to_json()["left_on_meta"] == ["inv_freq"]
    assert load_into(WithRotary(), path).left_on_meta == ()  # copied, nothing on meta


def test_a_copy_into_a_meta_model_is_refused_as_the_no_op_it_would_be(tmp_path: Path) -> None:
    # torch's load_state_dict(assign=False) only warns, and the weights stay unmade.
    path = tmp_path / "lin.pt"
    torch.save(nn.Linear(4, 2).state_dict(), path)
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="no-op"):
        model.load_state_dict(torch.load(path, weights_only=True))
    with pytest.raises(UsageError, match=r"2 of the model's tensors .* meta device") as e:
        load_into(model, path, assign=False)
    assert e.value.argument == "assign" and "assign=True" in str(e.value)
    assert model.weight.is_meta


def test_each_tensor_left_on_meta_is_said_with_why(tmp_path: Path) -> None:
    # A head of another shape (skipped), a bias the file lacks (missing) and a buffer no state
    # dict holds: three reasons, each named with its tensors.
    sd = {"proj.weight": torch.ones(3, 4)}  # the model's is [4, 4]; no proj.bias
    torch.save(sd, tmp_path / "partial.pt")
    with torch.device("meta"):
        model = WithRotary()
    report = load_into(model, tmp_path / "partial.pt", strict=False)
    assert set(report.left_on_meta) == {"proj.weight", "proj.bias", "inv_freq"}
    said = report.text()
    assert "proj.weight (shape mismatch, skipped)" in said
    assert "proj.bias (missing from the checkpoint)" in said
    assert "inv_freq (no state dict holds it: a non-persistent buffer)" in said
    # A value the checkpoint itself holds on meta is said as such, not as a buffer.
    torch.save({"proj.weight": torch.empty(4, 4, device="meta")}, tmp_path / "unmade.pt")
    with torch.device("meta"):
        model = WithRotary()
    report = load_into(model, tmp_path / "unmade.pt", strict=False)
    assert report.meta_values == ("proj.weight",)
    assert "proj.weight (the checkpoint holds it on meta, without values)" in report.text()
