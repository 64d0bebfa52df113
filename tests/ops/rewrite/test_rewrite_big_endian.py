"""Rewrites of big-endian torch zips: refused where the output would change values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_tools import convert, load_state_dict, slim, strip_module
from ckpt_tools.errors import UnsupportedFormatError, UsageError
from tests.helpers.byteorder import big_endian_copy
from tests.helpers.servers import HubServer


def _saved(tmp_path: Path, sd: dict[str, torch.Tensor]) -> Path:
    torch.save(sd, tmp_path / "little.pt")
    return big_endian_copy(tmp_path / "little.pt", tmp_path / "big.pt")


@pytest.mark.parametrize("op", ["strip_module", "convert"])
def test_a_rewrite_of_wide_big_endian_storages_is_refused(tmp_path: Path, op: str) -> None:
    src = _saved(tmp_path, {"module.w": torch.randn(4), "module.b": torch.ones(2).half()})
    dst = tmp_path / ("out.pt" if op == "strip_module" else "out.safetensors")
    run = {"strip_module": strip_module, "convert": convert}[op]
    with pytest.raises(UnsupportedFormatError, match="big-endian"):
        run(src, dst)
    assert not dst.exists()
    # What the refusal says does work: torch.load swaps the values back.
    assert torch.equal(
        torch.load(src, weights_only=True)["module.w"],
        torch.load(tmp_path / "little.pt", weights_only=True)["module.w"],
    )


def test_one_byte_storages_are_rewritten_and_load_equal_in_torch(tmp_path: Path) -> None:
    sd = {"module.mask": torch.tensor([True, False]), "module.q": torch.arange(4, dtype=torch.int8)}
    src = _saved(tmp_path, sd)
    strip_module(src, tmp_path / "out.pt")
    want = torch.load(src, weights_only=True)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(got) == ["mask", "q"]
    for name in got:
        assert torch.equal(got[name], want[f"module.{name}"]), name


def test_a_big_endian_file_at_a_url_is_told_to_be_downloaded_first(
    tmp_path: Path, hub: HubServer
) -> None:
    # load_state_dict, which the refusal names, reads local files only.
    url = hub.put_file("big.pt", _saved(tmp_path, {"w": torch.randn(4)}))
    with pytest.raises(UnsupportedFormatError, match="big-endian") as refused:
        slim(url, tmp_path / "out.pt")
    assert "download it first" in str(refused.value)
    with pytest.raises(UsageError, match="URL"):
        load_state_dict(url)
