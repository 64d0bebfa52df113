"""Reading torch.distributed.checkpoint (DCP) folders torch-free: detection, nesting, values,
and refusal of mutated metadata (each mutation made on the real pickle torch wrote)."""

from __future__ import annotations

import collections
import datetime
import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_tools import inspect
from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import CorruptCheckpointError, UnsafeContentError, UnsupportedFormatError
from ckpt_tools.formats import detect_format, open_checkpoint
from ckpt_tools.formats.dcp.metadata import read_metadata
from tests.helpers.cli import run_ckpt


def save_dcp(folder: Path, state: dict[str, Any]) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def small_state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": {
            "layers.0.weight": torch.randn(4, 3),
            "layers.0.bias": torch.randn(4).to(torch.bfloat16),
            "ids": torch.arange(5),
            "mask": torch.tensor([True, False]),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "epoch": 7,
    }


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return save_dcp(tmp_path / "ckpt", small_state())


def mutate(folder: Path, change: Any) -> None:
    """Load the metadata with torch's own pickle, change it, write it back."""
    path = folder / ".metadata"
    with open(path, "rb") as f:
        meta = pickle.load(f)
    change(meta)
    with open(path, "wb") as f:
        pickle.dump(meta, f)


def test_detected_and_nested_as_planner_data_says(folder: Path) -> None:
    assert detect_format(folder) == "dcp"
    ckpt = open_checkpoint(folder)
    expected = small_state()
    # Dotted keys stay one key (planner_data), never split: "layers.0.weight" is not nested.
    assert list(ckpt.root["model"]) == list(expected["model"])
    for name, tensor in expected["model"].items():
        got = ckpt.root["model"][name]
        assert isinstance(got, TensorRef)
        assert (got.dtype, got.shape) == (str(tensor.dtype).removeprefix("torch."), tensor.shape)
    # Non-tensor values came through the restricted unpickler, nested as saved.
    assert ckpt.root["epoch"] == 7
    assert ckpt.root["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert set(ckpt.root["optim"]["state"]["0"]) == {"step", "exp_avg"}
    assert ckpt.unsafe_globals == ()


def test_a_folder_whose_distcp_files_are_missing_is_dcp_and_names_them(folder: Path) -> None:
    for data in folder.glob("*.distcp"):
        data.unlink()
    # As DCP's loader: the .metadata makes the folder, and reading it names a missing shard.
    assert detect_format(folder) == "dcp"
    with pytest.raises(CorruptCheckpointError, match=r"'__0_0\.distcp', which is missing"):
        open_checkpoint(folder)


def test_chunks_located_in_their_files(folder: Path) -> None:
    meta = read_metadata(str(folder))
    item = meta.items["model.layers.0.weight"]
    (chunk,) = item.chunks
    assert (chunk.offsets, chunk.sizes) == ((0, 0), (4, 3))
    ckpt = open_checkpoint(folder)
    data = ckpt.chunk_tensor(item, chunk)
    with open(data.span.path, "rb") as f:
        f.seek(data.span.offset)
        raw = f.read(data.span.nbytes)
    assert raw == small_state()["model"]["layers.0.weight"].numpy().tobytes()


def test_inspect_json_lists_chunks(folder: Path) -> None:
    out = json.loads(run_ckpt("inspect", folder, "--json").stdout)
    assert out["format"] == "dcp"
    assert out["selected"] == ["model"]
    chunk = out["chunks"]["ids"][0]
    meta = read_metadata(str(folder)).items["model.ids"].chunks[0]
    assert chunk == {
        "offsets": [0],
        "sizes": [5],
        "file": meta.file,
        "offset": meta.offset,
        "length": meta.length,
    }
    assert "__0_0.distcp" in str(inspect(folder))


def test_a_limit_cuts_the_chunk_table_and_says_how_to_see_it_all(folder: Path) -> None:
    info = inspect(folder)
    chunks = sum(len(c) for c in info.chunks.values())
    assert chunks > 1
    assert info.chunk_table().count("\n") == chunks + 1  # a header, a rule, a line a chunk
    cut = info.chunk_table(limit=1)
    assert cut.endswith(f"\n... {chunks - 1} more chunks (raise limit=)")
    assert cut.count("\n") == 3
    printed = run_ckpt("inspect", folder, "--limit", "1").stdout
    assert f"... {chunks - 1} more chunks (drop --limit)" in printed


def _first_tensor(meta: Any) -> Any:
    return meta.state_dict_metadata["model.layers.0.weight"]


def _first_storage(meta: Any) -> Any:
    return next(v for k, v in meta.storage_data.items() if k.fqn == "model.layers.0.weight")


def _grow_chunk(meta: Any) -> None:
    _first_tensor(meta).chunks[0].sizes = torch.Size([5, 3])


def _split_overlapping(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    tensor = _first_tensor(meta)
    tensor.chunks[0].sizes = torch.Size([3, 3])
    tensor.chunks.append(ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([1, 3])))
    meta.storage_data[MetadataIndex("model.layers.0.weight", [2, 0])] = _first_storage(meta)


def _past_the_end(meta: Any) -> None:
    _first_storage(meta).length += 10**6


def _climbs_out(meta: Any) -> None:
    _first_storage(meta).relative_path = "../elsewhere.distcp"


def _swap_storages(meta: Any) -> None:
    a = next(k for k in meta.storage_data if k.fqn == "model.layers.0.weight")
    b = next(k for k in meta.storage_data if k.fqn == "model.ids")
    meta.storage_data[a], meta.storage_data[b] = meta.storage_data[b], meta.storage_data[a]


def _unknown_item(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta.storage_data[MetadataIndex("ghost")] = _first_storage(meta)


def _list_bomb(meta: Any) -> None:
    # DCP's own set_element would grow a list of 10**9 Nones for this path.
    meta.planner_data["epoch"] = ("epoch", 10**9)


def _too_deep(meta: Any) -> None:
    meta.planner_data["epoch"] = ("a",) * 1000


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (_list_bomb, "planner_data places 'epoch'"),
        (_too_deep, "planner_data places 'epoch'"),
        (_grow_chunk, "lies outside its shape"),
        (_split_overlapping, "overlapping chunks"),
        (_past_the_end, r"__0_0\.distcp' is truncated: it holds"),
        (_climbs_out, "not a file name inside the folder"),
        (_unknown_item, "storage entries for unknown items"),
    ],
)
def test_mutated_metadata_refused(folder: Path, change: Any, match: str) -> None:
    mutate(folder, change)
    with pytest.raises(CorruptCheckpointError, match=match):
        open_checkpoint(folder)
    assert "error" in run_ckpt("inspect", folder, code=4).stderr


def test_chunk_archive_of_another_tensor_refused(folder: Path, tmp_path: Path) -> None:
    mutate(folder, _swap_storages)
    ckpt = open_checkpoint(folder)  # the metadata alone is consistent
    with pytest.raises(CorruptCheckpointError, match="the metadata says float32"):
        from ckpt_tools import consolidate

        consolidate(folder, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    assert ckpt.format == "dcp"


def test_compression_transform_refused_by_name(folder: Path) -> None:
    def zstd(meta: Any) -> None:
        _first_storage(meta).transform_descriptors = ["stream.zstd/1"]

    mutate(folder, zstd)
    with pytest.raises(UnsupportedFormatError, match=r"stream\.zstd/1"):
        open_checkpoint(folder)


def test_foreign_global_in_metadata_is_unsafe(folder: Path) -> None:
    def smuggle(meta: Any) -> None:
        meta.planner_data["epoch"] = collections.OrderedDict(when=datetime.datetime(2020, 1, 1))

    mutate(folder, smuggle)
    with pytest.raises(UnsafeContentError, match=r"datetime\.datetime"):
        open_checkpoint(folder)
    run_ckpt("inspect", folder, code=3)


def test_dcp_classes_stay_refused_in_a_torch_file(tmp_path: Path) -> None:
    # Allowed in .metadata only: torch.load(weights_only=True) refuses them in a checkpoint.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = tmp_path / "c.pt"
    torch.save({"c": ChunkStorageMetadata(torch.Size([1]), torch.Size([2]))}, path)
    assert "torch.distributed.checkpoint.metadata.ChunkStorageMetadata" in (
        open_checkpoint(path).unsafe_globals
    )
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


class Custom:
    """A value DCP pickles with torch.save (BYTE_IO): a global outside the allowlist."""

    def __init__(self) -> None:
        self.x = 1


def test_unsafe_value_shown_not_run(tmp_path: Path) -> None:
    state = small_state()
    state["custom"] = Custom()
    folder = save_dcp(tmp_path / "ckpt", state)
    info = inspect(folder)
    assert info.unsafe_globals == (f"{__name__}.Custom",)
    assert info.format == "dcp"


def _member(obj: Any) -> tuple[Any, ...]:
    """What Python 3.11.0-3.11.4 pickle an enum member as: ``getattr(Enum, "NAME")``."""
    return (type(obj), obj.name)


def enums_by_name(
    folder: Path, args: Any = _member, protocol: int = pickle.DEFAULT_PROTOCOL
) -> bytes:
    """Write the folder's ``.metadata`` again with each enum member pickled as
    ``getattr(*args(member))``; the default is byte for byte what Python 3.11.0-3.11.4 write."""
    import enum
    import io

    class ByName(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            return (getattr, args(obj)) if isinstance(obj, enum.Enum) else NotImplemented

    path = folder / ".metadata"
    with open(path, "rb") as f:
        meta = pickle.load(f)
    buf = io.BytesIO()
    ByName(buf, protocol=protocol).dump(meta)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


@pytest.mark.parametrize("protocol", [2, 4])
def test_enum_members_pickled_by_name_read_as_by_value(folder: Path, protocol: int) -> None:
    by_value = read_metadata(str(folder))
    written = enums_by_name(folder, protocol=protocol)
    # Protocol 2 names it as Python 2 did (GLOBAL __builtin__ getattr), 4 as builtins.
    assert (b"__builtin__\ngetattr" if protocol == 2 else b"\x8c\x07getattr") in written
    assert b"TORCH_CONTIGUOUS_FORMAT" in written
    assert read_metadata(str(folder)) == by_value
    # torch's own reader takes the file as it is (a plain pickle.load).
    from torch.distributed.checkpoint import FileSystemReader

    assert sorted(FileSystemReader(str(folder)).read_metadata().state_dict_metadata) == sorted(
        by_value.items
    )
    info = inspect(folder)
    assert info.format == "dcp" and info.unsafe_globals == ()
    run_ckpt("inspect", folder)


def test_enum_members_by_name_consolidate_as_torch_does(folder: Path, tmp_path: Path) -> None:
    from ckpt_tools import consolidate
    from tests.helpers.dcp_save import reference

    consolidate(folder, tmp_path / "by_value.pt", include_all=True)
    enums_by_name(folder)
    consolidate(folder, tmp_path / "by_name.pt", include_all=True)
    records = [_records(tmp_path / name) for name in ("by_value.pt", "by_name.pt")]
    assert records[0] == records[1]
    want = reference(folder, tmp_path / "theirs.pt")
    got = torch.load(tmp_path / "by_name.pt", weights_only=True)
    assert got["epoch"] == want["epoch"]
    for key, tensor in want["model"].items():
        assert got["model"][key].dtype == tensor.dtype and torch.equal(got["model"][key], tensor)


def _records(path: Path) -> dict[str, bytes]:
    """A torch zip's records, but its serialization id (random on every save)."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("/serialization_id")}


def _properties_getattr(meta: Any) -> None:
    # The getattr function itself as a value (named, never called), in a field our reader
    # does not look at: pickle.load keeps it.
    meta.storage_meta = getattr


def _by_value_then(args: Any) -> Any:
    def change(folder: Path) -> None:
        enums_by_name(folder, args)

    return change


def _classmethod_of_a_dcp_class(obj: Any) -> tuple[Any, ...]:
    from torch.distributed.checkpoint.metadata import TensorProperties

    return (TensorProperties, "create_from_tensor")


HOSTILE_GETATTR = {
    # pickle.load gives a bound classmethod of another DCP class.
    "another class": _by_value_then(_classmethod_of_a_dcp_class),
    "a dunder": _by_value_then(lambda obj: (type(obj), "__class__")),
    "a plain attribute that is not a member": _by_value_then(lambda obj: (type(obj), "mro")),
    "a name that is not a str": _by_value_then(lambda obj: (type(obj), obj.value)),
    "three arguments": _by_value_then(lambda obj: (type(obj), obj.name, None)),
    "a value": lambda folder: mutate(folder, _properties_getattr),
}


@pytest.mark.parametrize("change", HOSTILE_GETATTR.values(), ids=list(HOSTILE_GETATTR))
def test_getattr_in_any_other_form_refused(folder: Path, change: Any) -> None:
    change(folder)
    assert b"getattr" in (folder / ".metadata").read_bytes()
    with pytest.raises(UnsafeContentError, match=r"builtins\.getattr") as caught:
        open_checkpoint(folder)
    assert "builtins.getattr" in caught.value.globals
    run_ckpt("inspect", folder, code=3)


def test_enum_getattr_stays_refused_in_a_torch_file(tmp_path: Path) -> None:
    # Allowed in .metadata only: in a checkpoint's data.pkl it stays a global off the list.
    import enum
    import types

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    class ByName(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            return (getattr, _member(obj)) if isinstance(obj, enum.Enum) else NotImplemented

    module = types.SimpleNamespace(Pickler=ByName, __name__="pickle")
    path = tmp_path / "m.pt"
    torch.save({"m": _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT}, path, pickle_module=module)
    assert b"getattr" in Path(path).read_bytes()
    # Named as written: torch.save writes protocol 2, whose name is Python 2's.
    assert {"builtins.getattr", "__builtin__.getattr"} & set(open_checkpoint(path).unsafe_globals)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


def test_every_reader_of_a_dcp_folder_says_consolidate_it(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Saved in one process, each tensor is one chunk, yet still its own archive in a .distcp
    # file: the folder needs consolidating. One reason, one remedy, a usage refusal (exit 2),
    # whichever command or call meets it.
    import ckpt_tools as ct
    from ckpt_tools.cli.main import main
    from ckpt_tools.errors import UsageError

    torch.save(small_state()["model"], tmp_path / "x.pt")
    remedy = f"ckpt consolidate {folder} OUT.pt"
    calls = [
        lambda: ct.load_state_dict(folder, select="model"),
        lambda: ct.load_with_info(folder, select="model"),
        lambda: ct.load_into(torch.nn.Linear(3, 4), folder, select="model", strict=False),
        lambda: ct.strip_module(folder, tmp_path / "o.pt"),
        lambda: ct.convert(folder, tmp_path / "o.pt"),
    ]
    for call in calls:
        with pytest.raises(UsageError) as e:
            call()
        message = str(e.value)
        assert not isinstance(e.value, CorruptCheckpointError), message
        assert "torch.distributed.checkpoint folder" in message and "own archive" in message
        assert remedy in message and "chunks across files" not in message
    for args in (
        ["diff", folder, tmp_path / "x.pt", "--select", "model"],
        ["convert", folder, "o.pt"],
    ):
        code = main([str(a) for a in args])
        err = capsys.readouterr().err
        assert code == 2, err
        assert remedy in err and "own archive" in err
    assert not (tmp_path / "o.pt").exists()


def test_a_folder_without_its_global_metadata_says_so(tmp_path: Path) -> None:
    # A save that did not finish (the .metadata is written last), not a Hugging Face folder.
    folder = save_dcp(tmp_path / "cut", small_state())
    (folder / ".metadata").unlink()
    err = run_ckpt("inspect", folder, code=4).stderr
    assert "holds torch.distributed.checkpoint files (__0_0.distcp" in err
    assert "but no .metadata" in err and "index.json" not in err
