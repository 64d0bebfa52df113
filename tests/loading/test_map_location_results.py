"""What a ``map_location`` gives back is checked as ``torch.load`` checks it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools import UnsupportedFormatError, UsageError, load_state_dict


@pytest.fixture
def zip_file(tmp_path: Path) -> Path:
    torch.save({"a": torch.arange(6.0)}, tmp_path / "zip.pt")
    return tmp_path / "zip.pt"


@pytest.fixture
def legacy_file(tmp_path: Path) -> Path:
    path = tmp_path / "legacy.pt"
    torch.save({"a": torch.arange(6.0)}, path, _use_new_zipfile_serialization=False)
    return path


def _torch_refuses(path: Path, map_location: Any) -> None:
    with warnings.catch_warnings(), pytest.raises((TypeError, RuntimeError)):
        warnings.simplefilter("ignore")
        torch.load(path, weights_only=True, map_location=map_location)


_NOT_STORAGES: dict[str, Callable[[torch.UntypedStorage, str], Any]] = {
    "tensor": lambda s, tag: torch.ones(3),
    "bigger tensor": lambda s, tag: torch.ones(12),
    "device name": lambda s, tag: "cpu",
    "int": lambda s, tag: 5,
    "short storage": lambda s, tag: s[:8],
}


@pytest.mark.parametrize("trust", [False, True], ids=["own", "trusted"])
@pytest.mark.parametrize("name", list(_NOT_STORAGES))
def test_callable_result_torch_refuses_is_refused(zip_file: Path, name: str, trust: bool) -> None:
    func = _NOT_STORAGES[name]
    _torch_refuses(zip_file, func)

    with pytest.raises(UsageError, match="map_location"):
        load_state_dict(zip_file, map_location=func, trust=trust)


@pytest.mark.parametrize("trust", [False, True], ids=["own", "trusted"])
def test_legacy_callable_result_of_another_size_is_refused(legacy_file: Path, trust: bool) -> None:
    def longer(storage: torch.UntypedStorage, tag: str) -> torch.UntypedStorage:
        return torch.UntypedStorage(storage.nbytes() + 64).fill_(0)

    _torch_refuses(legacy_file, longer)
    with pytest.raises(UsageError, match="map_location"):
        load_state_dict(legacy_file, map_location=longer, trust=trust)


@pytest.mark.parametrize("map_location", [torch.device("meta", 0), "meta:0"], ids=repr)
def test_meta_with_an_index_is_refused_cleanly(legacy_file: Path, map_location: Any) -> None:
    # torch refuses both for a legacy file (and "meta:0" for any file).
    _torch_refuses(legacy_file, map_location)
    with pytest.raises(UsageError) as refused:
        load_state_dict(legacy_file, map_location=map_location)
    assert refused.value.argument == "map_location"
    assert "'meta'" in str(refused.value)


def test_dict_of_torch_devices_is_refused(zip_file: Path) -> None:
    map_location = {"cpu": torch.device("cpu")}
    _torch_refuses(zip_file, map_location)
    with pytest.raises(UsageError) as refused:
        load_state_dict(zip_file, map_location=map_location)
    assert refused.value.argument == "map_location"
    assert "{'cpu': 'cpu'}" in str(refused.value)


@pytest.mark.parametrize("trust", [False, True])
def test_a_callable_that_keeps_a_missing_device_is_refused_as_none_is(
    zip_file: Path, tmp_path: Path, trust: bool
) -> None:
    # None from the callable means "where saved", as map_location=None does.
    from ckpt_tools import retag

    cuda = retag(zip_file, tmp_path / "cuda9.pt", mapping={"cpu": "cuda:9"}).dst
    _torch_refuses(cuda, lambda storage, tag: None)
    with pytest.raises(UsageError, match="saved on 'cuda:9' to 'cuda:9', which does not exist"):
        load_state_dict(cuda, map_location=lambda storage, tag: None, trust=trust)


def test_a_failure_inside_torch_load_under_trust_is_one_checkpoint_error(tmp_path: Path) -> None:
    # torch cannot load a complex32 leaf that requires grad (its rebuild copies in place).
    path = tmp_path / "chalf.pt"
    torch.save({"w": torch.zeros(3, dtype=torch.complex32, requires_grad=True)}, path)
    _torch_refuses(path, None)
    with pytest.raises(UnsupportedFormatError, match=r"torch\.load.*failed: RuntimeError") as e:
        load_state_dict(path, trust=True)
    assert e.value.remedies[0].argument == "trust" and "trust=False" in str(e.value)
    assert load_state_dict(path)["w"].dtype == torch.complex32


def test_an_error_of_the_map_location_callable_under_trust_is_its_own(zip_file: Path) -> None:
    def broken(storage: Any, tag: str) -> Any:
        raise RuntimeError("the caller's own bug")

    for trust in (False, True):
        with pytest.raises(RuntimeError, match="the caller's own bug") as e:
            load_state_dict(zip_file, map_location=broken, trust=trust)
        assert not isinstance(e.value, UnsupportedFormatError)
