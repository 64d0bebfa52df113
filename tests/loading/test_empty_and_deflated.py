"""Empty state dicts load as torch.load gives them; deflated records refuse ``mmap=True``."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ckpt_tools import StateDictMismatchError, UsageError, load_into, load_state_dict


@pytest.fixture
def empty_pt(tmp_path: Path) -> Path:
    torch.save({}, tmp_path / "empty.pt")
    return tmp_path / "empty.pt"


def test_empty_torch_file_loads_as_torch_load(empty_pt: Path) -> None:
    assert load_state_dict(empty_pt, map_location="cpu") == torch.load(empty_pt, weights_only=True)


def test_empty_safetensors_loads_as_load_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.safetensors"
    save_file({}, path)
    assert load_state_dict(path, map_location="cpu") == load_file(path)


def test_empty_file_into_a_model_reports_what_torch_reports(empty_pt: Path) -> None:
    sd = torch.load(empty_pt, weights_only=True)
    ref = nn.Linear(2, 2).load_state_dict(sd, strict=False)
    with pytest.raises(RuntimeError):
        nn.Linear(2, 2).load_state_dict(sd, strict=True)

    report = load_into(nn.Linear(2, 2), empty_pt, map_location="cpu", strict=False)

    assert sorted(report.missing) == sorted(ref.missing_keys)
    assert list(report.unexpected) == ref.unexpected_keys
    with pytest.raises(StateDictMismatchError):
        load_into(nn.Linear(2, 2), empty_pt, map_location="cpu", strict=True)


@pytest.mark.parametrize(
    ("checkpoint", "where"),
    [
        ({"state_dict": {}, "epoch": 1}, ("state_dict",)),
        ({"trainer": 3, "model": {"state_dict": {}}}, ("model", "state_dict")),
    ],
    ids=["state_dict", "nested"],
)
def test_an_empty_state_dict_under_its_name_loads_as_torch_gives_it(
    tmp_path: Path, checkpoint: dict, where: tuple[str, ...]
) -> None:
    path = tmp_path / "no_parameters.pt"
    torch.save(checkpoint, path)
    theirs = torch.load(path, weights_only=True)
    for key in where:
        theirs = theirs[key]
    ours = load_state_dict(path, map_location="cpu")
    assert ours == theirs == {}
    report = load_into(nn.ReLU(), path, map_location="cpu")
    assert (report.missing, report.unexpected) == ((), ())


@pytest.mark.parametrize(
    "module", [nn.ReLU(), nn.Sequential(nn.ReLU(), nn.Dropout())], ids=["relu", "sequential"]
)
def test_a_pickled_module_without_parameters_loads_its_empty_state_dict(
    tmp_path: Path, module: nn.Module
) -> None:
    path = tmp_path / "module.pt"
    torch.save(module, path)
    theirs = torch.load(path, weights_only=False).state_dict()  # our own file: safe to run
    assert load_state_dict(path, map_location="cpu") == theirs == {}
    report = load_into(nn.ReLU(), path, map_location="cpu")
    assert (report.missing, report.unexpected) == ((), ())


def test_no_state_dict_beside_an_empty_entry_of_another_name_is_still_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "no_weights.pt"
    torch.save({"optimizer": {}, "epoch": 1}, path)
    with pytest.raises(UsageError, match="no entry looks like a state dict"):
        load_state_dict(path, map_location="cpu")


@pytest.fixture
def deflated(tmp_path: Path) -> Path:
    torch.save({"a": torch.arange(6, dtype=torch.float32)}, tmp_path / "stored.pt")
    out = tmp_path / "deflated.pt"
    with (
        zipfile.ZipFile(tmp_path / "stored.pt") as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out


def test_deflated_record_refuses_mmap(deflated: Path) -> None:
    ref = torch.load(deflated, weights_only=True)
    # torch maps the compressed bytes as they lie: not the values it reads without mmap.
    assert not torch.equal(torch.load(deflated, weights_only=True, mmap=True)["a"], ref["a"])

    with pytest.raises(UsageError) as refused:
        load_state_dict(deflated, map_location="cpu", mmap=True)

    assert refused.value.argument == "mmap"
    assert "compressed" in str(refused.value) and "mmap=False" in str(refused.value)
    assert torch.equal(load_state_dict(deflated, map_location="cpu")["a"], ref["a"])


def test_trust_refuses_to_map_a_deflated_record(deflated: Path) -> None:
    # torch.load(mmap=True), which trust hands the file to, would map compressed bytes.
    with pytest.raises(UsageError, match="compressed") as refused:
        load_state_dict(deflated, map_location="cpu", trust=True, mmap=True)
    assert refused.value.argument == "mmap"
    ref = torch.load(deflated, weights_only=True)
    assert torch.equal(load_state_dict(deflated, trust=True)["a"], ref["a"])


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("options", [{}, {"mmap": False}, {"mmap": True}])
def test_load_into_copies_a_deflated_file_it_cannot_map(
    deflated: Path, trust: bool, options: dict
) -> None:
    # Mapping was only its staging area: the records are inflated instead.
    model = nn.Module()
    model.register_buffer("a", torch.zeros(6))
    report = load_into(model, deflated, trust=trust, **options)
    assert report.loaded == 1 and not report.info.mmap
    assert torch.equal(model.a, torch.load(deflated, weights_only=True)["a"])


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_empty_views_of_several_dtypes_on_one_storage_keep_their_own(
    tmp_path: Path, legacy: bool
) -> None:
    # torch.save skips its one-dtype-per-storage check for an empty storage, and torch.load
    # makes an empty storage anew for each reference, of that reference's type.
    from ckpt_tools import convert, inspect

    x = torch.empty(0, 3)
    src = tmp_path / "empty.pt"
    views = {"a": x, "b": x.view(torch.int32), "c": x.view(torch.bfloat16)}
    torch.save(views, src, _use_new_zipfile_serialization=not legacy)
    want = {k: (v.dtype, v.shape) for k, v in torch.load(src, weights_only=True).items()}
    assert [d for d, _ in want.values()] == [torch.float32, torch.int32, torch.bfloat16]
    got = {k: (v.dtype, v.shape) for k, v in load_state_dict(src).items()}
    assert got == want
    convert(src, tmp_path / "out.pt")
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k: (v.dtype, v.shape) for k, v in written.items()} == want
    convert(src, tmp_path / "out.safetensors")
    stored = load_file(tmp_path / "out.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in stored.items()} == want
    assert [t.dtype for t in inspect(src).tensors] == ["float32", "int32", "bfloat16"]


def test_an_empty_reference_to_a_storage_with_bytes_is_that_storage(tmp_path: Path) -> None:
    # torch.load reuses a loaded storage that holds bytes: an empty reference of another
    # type to its key (a hand-edited pickle) is a view of it, of its dtype.
    from ckpt_tools import inspect

    torch.save({"a": torch.arange(5.0), "b": torch.empty(0, dtype=torch.int32)}, tmp_path / "s.pt")
    src = tmp_path / "edited.pt"
    with zipfile.ZipFile(tmp_path / "s.pt") as zin, zipfile.ZipFile(src, "w") as out:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data.pkl"):  # b's storage key '1' -> '0'
                data = data.replace(b"X\x01\x00\x00\x001", b"X\x01\x00\x00\x000")
            out.writestr(info, data)
    want = {k: v.dtype for k, v in torch.load(src, weights_only=True).items()}
    assert want == {"a": torch.float32, "b": torch.float32}
    assert {k: v.dtype for k, v in load_state_dict(src).items()} == want
    assert [t.dtype for t in inspect(src).tensors] == ["float32", "float32"]
