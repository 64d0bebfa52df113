"""A legacy file whose main pickle names a storage the file does not store is refused at open.

torch's legacy reader allocates every storage the main pickle names and fills only those the
storage key list names: a storage missing from the list loads as uninitialized memory. The
reader refuses the file instead, naming the key and the keys the file does store, so that
inspect and every loader refuse it the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint


def _renamed_in_main_pickle(tmp_path: Path) -> tuple[Path, str, str]:
    """A legacy file whose main pickle names one storage by a key the file does not store."""
    path = tmp_path / "bad_key.pt"
    base = torch.arange(16.0)
    torch.save({"a": base, "e": base[2:5]}, path, _use_new_zipfile_serialization=False)
    (key,) = open_checkpoint(str(path)).storages
    bad = key[:-1] + ("1" if key[-1] != "1" else "2")
    raw = path.read_bytes()
    # The main pickle comes before the key list: only its first mention of the key changes.
    path.write_bytes(raw.replace(key.encode(), bad.encode(), 1))
    return path, key, bad


@pytest.mark.parametrize(
    "read",
    [
        lambda p: open_checkpoint(str(p)),
        lambda p: ct.inspect(p),
        lambda p: ct.load_state_dict(p, map_location="cpu"),
    ],
    ids=["open", "inspect", "load_state_dict"],
)
def test_storage_the_file_does_not_store_is_refused(
    tmp_path: Path, read: Callable[[Path], object]
) -> None:
    path, key, bad = _renamed_in_main_pickle(tmp_path)
    with pytest.raises(CorruptCheckpointError) as caught:
        read(path)
    message = str(caught.value)
    assert str(path) in message
    assert repr(bad) in message
    assert repr(key) in message
