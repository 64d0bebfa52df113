"""The re-pickler: a tree read by ``load_pickle`` written back is what torch wrote.

Also: device tags changed on the way (``cpu`` -> ``cuda:1``), which gives a checkpoint that
claims a GPU on a machine without one.
"""

from __future__ import annotations

import collections
import io
import pickle
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt_tools
from ckpt_tools.descriptors import GlobalRef, StorageRef, TensorRef
from ckpt_tools.errors import CheckpointError, CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from ckpt_tools.formats.pickle import repickle
from ckpt_tools.formats.pickle.repickle import Repickler, dumps, zip_storage_id
from tests.helpers import (
    assert_bitwise_equal,
    by_name,
    fixture_path,
    fixtures_where,
    read_data_pkl,
    repickle_zip,
)

ZIPS = fixtures_where(format="torch-zip", oracle="torch")
SCRIPTS = fixtures_where(format="torchscript")
REGRESSIONS = Path(__file__).resolve().parents[2] / "fuzz" / "regressions"


@pytest.mark.parametrize("entry", **by_name(ZIPS))
def test_repickled_zip_loads_as_the_original(entry: dict[str, Any], tmp_path: Path) -> None:
    src, dst = fixture_path(entry["name"]), tmp_path / entry["name"]
    payload = repickle_zip(src, dst, protocol=2)
    assert payload == read_data_pkl(src), "torch's data.pkl is re-emitted byte for byte"
    assert_bitwise_equal(torch.load(src, weights_only=True), torch.load(dst, weights_only=True))


@pytest.mark.parametrize("entry", **by_name(SCRIPTS))
def test_repickled_torchscript_loads_with_jit(entry: dict[str, Any], tmp_path: Path) -> None:
    src, dst = fixture_path(entry["name"]), tmp_path / entry["name"]
    repickle_zip(src, dst, protocol=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert_bitwise_equal(
            dict(torch.jit.load(src).state_dict()), dict(torch.jit.load(dst).state_dict())
        )


@pytest.mark.parametrize("name", ["trainer_adam.pt", "tied_views.pt", "dtypes.pt"])
def test_retagged_devices(name: str, tmp_path: Path) -> None:
    """Storages saved as cuda:1 (crafted: no GPU here) are reported as cuda:1 and still load."""
    src, dst = fixture_path(name), tmp_path / name
    payload = repickle_zip(src, dst, protocol=2, device_map={"cpu": "cuda:1"})
    assert b"cuda:1" in payload and b"cpu" not in payload

    info, before = ckpt_tools.inspect(dst), ckpt_tools.inspect(src)
    assert info.tensors and info.devices == {"cuda:1": len(info.tensors)}
    assert list(info.tensors) == [replace(t, device="cuda:1") for t in before.tensors]

    seen: list[str] = []

    def record(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage

    retagged = torch.load(dst, map_location=record, weights_only=True)
    assert set(seen) == {"cuda:1"}, "torch reads the new tag"
    assert_bitwise_equal(torch.load(src, weights_only=True), retagged)
    assert_bitwise_equal(retagged, torch.load(dst, map_location="cpu", weights_only=True))


def _torch_saved(tmp_path: Path) -> list[Path]:
    """torch.save's own files: the committed ones, and dicts whose sizes cross pickle batches."""
    made = []
    for n in (1, 999, 1000, 1001, 2000):
        sd = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(n)}
        made.append(tmp_path / f"sd{n}.pt")
        torch.save(sd, made[-1])
    od = collections.OrderedDict((f"b{i}", torch.zeros(1)) for i in range(1000))
    torch.save({"state_dict": od, "epoch": 3, "names": ["x"] * 1000}, tmp_path / "nested.pt")
    return made + [tmp_path / "nested.pt"] + [fixture_path(e["name"]) for e in ZIPS]


def test_dumps_writes_torch_saves_pickle_byte_for_byte(tmp_path: Path) -> None:
    """Read and written back unchanged, a torch.save'd pickle comes out as torch wrote it."""
    for path in _torch_saved(tmp_path):
        ckpt = open_checkpoint(path)
        assert dumps(ckpt.root, 2, zip_storage_id()) == read_data_pkl(path), path.name


def test_the_fast_pickler_matches_the_reference_repickler() -> None:
    """The C pickler and the pure-Python reference write the same bytes, for every fixture
    and fuzz regression that reads. (Not for a plain dict of 1000 * k or 1000 * k + 1 items:
    the C pickler batches those as torch.save's does, which the test above holds.)"""
    fixtures = fixture_path("model.pt").parent
    paths = sorted(fixtures.glob("*.pt")) + sorted(fixtures.glob("*.ckpt"))
    paths += sorted(REGRESSIONS.glob("*.pt"))
    compared = 0
    for path in paths:
        try:
            ckpt = open_checkpoint(path)
        except CheckpointError:
            continue  # refused inputs are the reader's tests
        reference = io.BytesIO()
        try:
            Repickler(reference, 2, zip_storage_id()).dump(ckpt.root)
        except RecursionError:
            continue  # (the pure-Python reference recurses: a tree thousands deep is past it)
        assert dumps(ckpt.root, 2, zip_storage_id()) == reference.getvalue(), path.name
        compared += 1
    assert compared >= 45  # (legacy and tar files among them)


def test_placeholder_globals_are_unbound_after_every_dump(tmp_path: Path) -> None:
    from ckpt_tools import descriptors
    from ckpt_tools.formats.pickle import allowlist, standins
    from ckpt_tools.formats.pickle import unpickler as pickles

    modules = (descriptors, pickles, standins, allowlist, repickle)
    before = [set(vars(m)) for m in modules]
    ckpt = open_checkpoint(fixture_path("trainer_adam.pt"))
    dumps(ckpt.root, 2, zip_storage_id())
    with pytest.raises(CorruptCheckpointError, match="without a rebuild function"):
        dumps(
            {"w": TensorRef(StorageRef("0", "float32", 1, "cpu"), 0, (1,), (1,), "float32")},
            2,
            zip_storage_id(),
        )
    assert [set(vars(m)) for m in modules] == before


def test_a_string_that_looks_like_a_placeholder_survives(tmp_path: Path) -> None:
    # A value holding the GLOBAL text the placeholders take (any token): kept as it was.
    fake = "cckpt_tools.formats.repickle\n_ckpt_global_00_0\n"
    path = tmp_path / "odd.pt"
    torch.save({fake: torch.ones(1), "note": "c" + fake, "epoch": 1}, path)
    ckpt = open_checkpoint(path)
    assert dumps(ckpt.root, 2, zip_storage_id()) == read_data_pkl(path)


@dataclass(frozen=True)
class _OwnRef(GlobalRef):
    """A caller's own GlobalRef subclass: its module is not one of ckpt_tools'."""


@pytest.mark.parametrize("module", [__name__, "copyreg", "not_imported_module"])
def test_a_callers_own_global_ref_is_written_by_name(module: str) -> None:
    # The C pickler could not be handed it (a module missing, or renamed to Python 2's
    # copy_reg on the way out): the reference pickler writes it, by its own name.
    cls = type("Own", (_OwnRef,), {"__module__": module})
    tree = {"dtype": cls("torch", "float32"), "other": _OwnRef("torch", "int8"), "n": 1}
    payload = dumps(tree, 2, zip_storage_id())
    reference = io.BytesIO()
    Repickler(reference, 2, zip_storage_id()).dump(tree)
    assert payload == reference.getvalue()
    assert b"ctorch\nfloat32\n" in payload and b"_ckpt_global_" not in payload
    # Our own bytes of a known tree (no checkpoint's), so pickle itself may read them.
    assert pickle.loads(payload) == {"dtype": torch.float32, "other": torch.int8, "n": 1}


def test_empty_bytes_read_from_protocol_4_are_written_as_weights_only_reads_them(
    tmp_path: Path,
) -> None:
    # Protocol 2 writes b"" as bytes(), a global weights_only refuses (torch.save's own
    # protocol-2 file of it does not load so); _codecs.encode("", "latin1") loads as b"".
    src = tmp_path / "p4.pt"
    value = {"w": torch.ones(2), "b": b"", "c": b"ab", "nested": [b"", (b"",)]}
    torch.save(value, src, pickle_protocol=4)
    ckpt = open_checkpoint(src)
    reference = io.BytesIO()
    Repickler(reference, 2, zip_storage_id()).dump(ckpt.root)
    payload = dumps(ckpt.root, 2, zip_storage_id())
    assert payload == reference.getvalue() and b"c__builtin__\nbytes\n" not in payload
    ckpt_tools.convert(src, tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k: v for k, v in got.items() if k != "w"} == {
        k: v for k, v in value.items() if k != "w"
    }
    assert type(got["nested"][1]) is tuple and torch.equal(got["w"], value["w"])
