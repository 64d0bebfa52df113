"""load_state_dict on our own reader, against torch.load(weights_only=True) as the oracle.

Every fixture layout and format, files made here (views, shared storages, strides, Parameters,
every dtype, empty and 0-d tensors, conjugate bits, meta tensors, legacy files) and the real
files of /work/shared/realckpt/github are loaded both ways and compared: keys and their order,
container types, ``_metadata``, and per tensor its type, dtype, shape, strides, storage
offset, storage size, requires_grad, conj/neg bits, device and bytes, and which tensors share
a storage.
"""

from __future__ import annotations

import glob
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ckpt_tools import load_state_dict, load_with_info
from ckpt_tools.errors import CorruptCheckpointError, UnsupportedFormatError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.structure.selection import walk_path

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
REAL = Path("/work/shared/realckpt/github")
# torch refuses these, or they hold no state dict; each has its own test elsewhere.
_NOT_LOADABLE = {"empty.pt", "evil.pt", "lfs_pointer.pt", "no_data_pkl.pt", "random.bin"}
_NOT_LOADABLE |= {"torchscript.pt", "truncated.pt", "numbers_p0.pkl", "numbers_p4.pkl"}


def _raw(tensor: torch.Tensor) -> bytes:
    if tensor.device.type == "meta":
        return b""
    if tensor.is_quantized:
        tensor = tensor.int_repr()
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(flat.cpu().view(torch.uint8).numpy())


def _sharing(sd: dict[Any, Any]) -> list[list[Any]]:
    """Keys grouped by the storage their tensor views (empty storages left out)."""
    groups: dict[int, list[Any]] = {}
    for key, value in sd.items():
        if (
            isinstance(value, torch.Tensor)
            and value.device.type != "meta"
            and value.layout == torch.strided
        ):
            storage = value.untyped_storage()
            if storage.nbytes():
                groups.setdefault(storage.data_ptr(), []).append(key)
    return sorted(groups.values(), key=lambda g: [str(k) for k in g])


def assert_like_torch(ours: Any, theirs: Any, where: str = "", sharing: bool = True) -> None:
    """``ours`` is what torch loaded, in every property a caller can see."""
    assert type(ours) is type(theirs), where
    if isinstance(theirs, torch.Tensor) and theirs.layout != torch.strided:
        assert ours.layout == theirs.layout and ours.dtype == theirs.dtype, where
        assert ours.shape == theirs.shape, where
        assert_like_torch(ours.to_dense(), theirs.to_dense(), where)
    elif isinstance(theirs, torch.Tensor):
        if theirs.is_quantized:
            assert ours.qscheme() == theirs.qscheme(), where
            if theirs.qscheme() == torch.per_tensor_affine:
                assert (ours.q_scale(), ours.q_zero_point()) == (
                    theirs.q_scale(),
                    theirs.q_zero_point(),
                ), where
            else:
                assert torch.equal(ours.q_per_channel_scales(), theirs.q_per_channel_scales())
                assert torch.equal(
                    ours.q_per_channel_zero_points(), theirs.q_per_channel_zero_points()
                )
                assert ours.q_per_channel_axis() == theirs.q_per_channel_axis(), where
        assert ours.dtype == theirs.dtype, where
        assert ours.shape == theirs.shape, where
        assert ours.stride() == theirs.stride(), where
        assert ours.storage_offset() == theirs.storage_offset(), where
        assert ours.requires_grad == theirs.requires_grad, where
        assert (ours.is_conj(), ours.is_neg()) == (theirs.is_conj(), theirs.is_neg()), where
        assert ours.device == theirs.device, where
        if theirs.device.type != "meta":
            assert ours.untyped_storage().nbytes() == theirs.untyped_storage().nbytes(), where
        assert _raw(ours) == _raw(theirs), where
    elif isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        assert getattr(ours, "_metadata", None) == getattr(theirs, "_metadata", None), where
        for key in theirs:
            assert_like_torch(ours[key], theirs[key], f"{where}.{key}", sharing=False)
        if sharing:
            assert _sharing(ours) == _sharing(theirs), where
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_like_torch(a, b, f"{where}.{i}", sharing=False)
    else:
        assert ours == theirs, where


def _compare_with_torch_load(path: str, *, weights_only: bool = True, **load: Any) -> None:
    ours, info = load_with_info(path, map_location="cpu")
    theirs_root = torch.load(path, weights_only=weights_only, map_location="cpu", **load)
    walk = walk_path(theirs_root, info.selected)
    assert walk.found
    assert_like_torch(ours, walk.node)


def _fixture_files() -> list[str]:
    names = sorted(p.name for p in FIXTURES.iterdir() if p.is_file())
    return [n for n in names if n not in _NOT_LOADABLE and not n.endswith((".md", ".py", ".json"))]


@pytest.mark.parametrize("name", _fixture_files())
def test_every_fixture_loads_as_torch_load_gives_it(name: str) -> None:
    path = str(FIXTURES / name)
    fmt = open_checkpoint(path).format
    if fmt == "safetensors":
        ours, info = load_with_info(path, mmap=True)
        assert info.mmap
        # safetensors gives each tensor its own storage: so does its oracle.
        assert_like_torch(ours, load_file(path))
    elif fmt == "torch-tar":
        # torch.load refuses weights_only=True on tar files; this one holds only allowlisted
        # globals (checked), so its unrestricted load runs nothing but torch's rebuilds.
        assert open_checkpoint(path).unsafe_globals == ()
        _compare_with_torch_load(path, weights_only=False)
    else:
        _compare_with_torch_load(path)


def test_the_sharded_fixture_merges_as_its_shards_load() -> None:
    folder = FIXTURES / "sharded"
    expected: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        expected.update(load_file(shard))
    ours = load_state_dict(folder)
    assert sorted(ours) == sorted(expected)
    for key, tensor in expected.items():
        assert_like_torch(ours[key], tensor, key)


def _real_files() -> list[str]:
    found = []
    for path in sorted(glob.glob(str(REAL / "**" / "*"), recursive=True)):
        if os.path.isfile(path) and not path.endswith((".json", ".md")):
            found.append(path)
    return found


@pytest.mark.skipif(not REAL.is_dir(), reason="no real checkpoints on this machine")
@pytest.mark.parametrize("path", _real_files(), ids=os.path.basename)
def test_real_github_checkpoints_load_as_torch_does(path: str) -> None:
    try:
        fmt = open_checkpoint(path).format
    except UnsupportedFormatError:  # the git-lfs pointer: refused by both
        with pytest.raises(UnsupportedFormatError):
            load_state_dict(path)
        return
    if fmt == "safetensors":
        assert_like_torch(load_state_dict(path), load_file(path))
    else:
        _compare_with_torch_load(path)


# --- files made here --------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two keys
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.ones(2, 3, dtype=torch.bool))


def _zoo() -> dict[str, Any]:
    torch.manual_seed(0)
    base = torch.arange(48, dtype=torch.float32)
    complex_base = torch.randn(5, dtype=torch.complex64)
    return OrderedDict(
        {
            "whole": base,
            "reshaped": base.view(6, 8),
            "offset": base[24:],
            "transposed": base.view(6, 8).t(),
            "strided": base.view(6, 8)[::2, 1::3],
            "expanded": torch.tensor([1.5, 2.5]).expand(3, 2),
            "param_frozen": nn.Parameter(torch.randn(3, 2), requires_grad=False),
            "param": nn.Parameter(torch.randn(2)),
            "grad_tensor": torch.randn(2).requires_grad_(),
            "bf16": torch.randn(3, 3).to(torch.bfloat16),
            "fp16": torch.randn(4).half(),
            "f64": torch.randn(2, dtype=torch.float64),
            "fp8": torch.randn(7).to(torch.float8_e4m3fn),
            "fp8_e5m2": torch.randn(7).to(torch.float8_e5m2),
            "c64": complex_base,
            "conj": complex_base.conj(),
            "c128": torch.randn(3, dtype=torch.complex128),
            "bool": torch.tensor([True, False, True]),
            "i64": torch.arange(5),
            "i32": torch.arange(5, dtype=torch.int32),
            "i16": torch.arange(5, dtype=torch.int16),
            "i8": torch.arange(-3, 3, dtype=torch.int8),
            "u8": torch.arange(250, 256, dtype=torch.uint8),
            "empty": torch.empty(0, 3),
            "empty_view": base[48:],
            "scalar": torch.tensor(3.25),
            "meta": torch.empty(2, 3, device="meta"),
            "extra._extra_state": {"n": 3, "dtype": torch.float16, "shape": torch.Size([2, 2])},
            "nested": [base[:4], (base[4:8],)],
            "device_note": torch.device("cpu"),
            "qint8": torch.quantize_per_tensor(torch.randn(4, 3), 0.05, 2, torch.qint8),
            "quint8_channels": torch.quantize_per_channel(
                torch.randn(3, 4),
                torch.tensor([0.1, 0.2, 0.3]),
                torch.tensor([0, 1, 2]),
                0,
                torch.quint8,
            ),
            "sparse_coo": torch.eye(4).to_sparse(),
            "sparse_csr": torch.eye(3).to_sparse_csr(),
        }
    )


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning")
@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_views_sharing_strides_parameters_and_dtypes_match_torch_load(
    tmp_path: Path, zipfile: bool
) -> None:
    zoo = _zoo()
    if not zipfile:
        # The legacy format cannot hold a meta tensor, and torch's legacy reader fails on the
        # untyped storages its writer gives float8 tensors.
        for key in ("meta", "fp8", "fp8_e5m2"):
            zoo.pop(key)
    path = str(tmp_path / "zoo.pt")
    torch.save(zoo, path, _use_new_zipfile_serialization=zipfile)
    _compare_with_torch_load(path)
    ours = load_state_dict(path)
    # Views of one storage stay views: writing through one is seen through the others.
    ours["whole"][30] = -1.0
    assert ours["offset"][6] == -1.0 and ours["reshaped"][3, 6] == -1.0


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_a_module_state_dict_keeps_metadata_and_tied_storages(
    tmp_path: Path, zipfile: bool
) -> None:
    model = Tied()
    path = str(tmp_path / "tied.pt")
    torch.save(
        {"model": model.state_dict(), "epoch": 2}, path, _use_new_zipfile_serialization=zipfile
    )
    _compare_with_torch_load(path)
    sd = load_state_dict(path)
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    assert sd._metadata[""]["version"] == model.state_dict()._metadata[""]["version"]


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_a_list_holding_itself_and_tensor_keys_load_as_torch_loads_them(
    tmp_path: Path, zipfile: bool
) -> None:
    w = torch.arange(4.0)
    loop: list[Any] = [w]
    loop.append(loop)
    path = str(tmp_path / "odd.pt")
    torch.save(
        {"sd": {"w": w}, "loop": loop, "keys": {w: "x", (w, 1): "y"}},
        path,
        _use_new_zipfile_serialization=zipfile,
    )
    want = torch.load(path, weights_only=True)
    got = load_state_dict(path, select=[])
    assert got["loop"][1] is got["loop"] and want["loop"][1] is want["loop"]
    assert torch.equal(got["loop"][0], want["loop"][0])
    assert [type(k).__name__ for k in got["keys"]] == [type(k).__name__ for k in want["keys"]]
    key, pair = list(got["keys"])
    assert torch.equal(key, w) and key.data_ptr() == got["sd"]["w"].data_ptr()
    assert pair[0] is key and pair[1] == 1 and list(got["keys"].values()) == ["x", "y"]


def test_a_mutated_zip_record_changes_the_loaded_bytes_as_torch_sees_them(tmp_path: Path) -> None:
    path = tmp_path / "mutated.pt"
    torch.save({"w": torch.zeros(64)}, path)
    ckpt = open_checkpoint(path)
    span = ckpt.span(ckpt.root["w"].storage)
    data = bytearray(path.read_bytes())
    data[span.offset + 4 * 10 : span.offset + 4 * 11] = torch.tensor([7.0]).numpy().tobytes()
    path.write_bytes(bytes(data))
    sd = load_state_dict(path)
    assert sd["w"][10] == 7.0 and int((sd["w"] != 0).sum()) == 1
    _compare_with_torch_load(str(path))


def test_a_file_cut_inside_a_legacy_storage_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cut.pt"
    torch.save({"w": torch.randn(1000)}, path, _use_new_zipfile_serialization=False)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CorruptCheckpointError, match=r"truncated|ends"):
        load_state_dict(path)


def test_loaded_zip_tensors_are_private_copy_on_write_maps(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(1024)}, path)
    before = path.read_bytes()
    sd = load_state_dict(path)
    sd["w"] += 1  # writes land in private pages (MAP_PRIVATE), never in the file
    assert path.read_bytes() == before
    assert bool((load_state_dict(path)["w"] == 0).all())


def test_a_big_endian_record_swaps_the_values_as_torch_swaps_them(tmp_path: Path) -> None:
    import zipfile

    source = tmp_path / "little.pt"
    torch.save({"w": torch.arange(4, dtype=torch.float32)}, source)
    big = tmp_path / "big.pt"
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(big, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("/byteorder"):
                assert data == b"little"
                data = b"big"
            dst.writestr(item, data)
    assert load_state_dict(source)["w"][1] == 1.0
    # The same bytes read big-endian: torch.load swaps each element, and so do we.
    want = torch.load(big, weights_only=True)["w"]
    assert not torch.equal(want, torch.arange(4, dtype=torch.float32))
    assert torch.equal(load_state_dict(big)["w"], want)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.parametrize("dtype", ["quint4x2", "quint2x4"])
def test_packed_quantized_tensors_are_refused_as_unread_not_as_corrupt(
    tmp_path: Path, dtype: str
) -> None:
    # Two (four) values to a byte: torch loads the file, whose storage is smaller than numel.
    path = tmp_path / "packed.pt"
    packed = torch.quantize_per_tensor(torch.tensor([0.0, 0.5, 1.0]), 0.5, 0, getattr(torch, dtype))
    torch.save({"q": packed, "w": torch.ones(2)}, path)
    assert torch.load(path, weights_only=True)["q"].dtype == packed.dtype
    with pytest.raises(UnsupportedFormatError, match=f"a {dtype} tensor packs"):
        open_checkpoint(path)
