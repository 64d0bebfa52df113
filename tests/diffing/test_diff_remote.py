"""``diff`` and ``ckpt diff`` with a URL on either side, against real servers started by the
suite: keys, shapes and dtypes from the structure; values only when asked, fetching only the
compared tensors (counted on the server's side)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict

from ckpt_tools import diff
from tests.helpers.cli import run_ckpt
from tests.test_torch_free import CKPT, without_torch

# What reading a checkpoint's structure may cost at most, whatever its size.
MAX_REQUESTS = 8
MAX_BYTES = 4 << 20


def _state_dict(prefix: str = "") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {f"{prefix}blocks.{i}.weight": torch.randn(128, 512, generator=gen) for i in range(12)}
    sd[f"{prefix}embed.weight"] = torch.randn(100, 64, generator=gen).to(torch.bfloat16)
    sd[f"{prefix}norm.num_batches_tracked"] = torch.tensor(3)
    return sd


@pytest.fixture
def served(hub, tmp_path: Path) -> tuple[str, Path, int]:
    """A .pt on the Hub look-alike: its URL, its local copy, and its tensors' bytes."""
    sd = _state_dict()
    local = tmp_path / "model.pt"
    torch.save(sd, local)
    return hub.put("org/model", "model.pt", local), local, sum(t.nbytes for t in sd.values())


def test_a_url_against_its_local_copy_compares_keys_shapes_and_dtypes(hub, served) -> None:
    url, local, _ = served
    report = diff(url, local)
    assert not report.values_compared and not report.found()
    assert not report.missing and not report.unexpected and len(report.tensors) == 14
    assert {t.status for t in report.tensors} == {"unchecked"}
    assert all(t.shape_a == t.shape_b and t.dtype_a == t.dtype_b for t in report.tensors)
    assert not report.identical  # not known without the values
    path = hub.path("org/model", "model.pt")
    assert hub.log.requests(path) <= MAX_REQUESTS and hub.log.sent(path) <= MAX_BYTES
    assert report.transfer.bytes_received == hub.log.sent()
    _, out, _ = run_ckpt("diff", url, str(local), code=0)
    assert "values: not compared (A is a URL" in out and "--values compares them" in out
    assert "same keys, shapes and dtypes (values not compared)" in out


def test_values_fetch_only_the_compared_tensors(hub, served) -> None:
    url, local, tensor_bytes = served
    _, out, err = run_ckpt("diff", "--values", "--verbose", "--json", url, str(local), code=0)
    data = json.loads(out)
    assert data["identical"] and data["values_compared"]
    assert {t["status"] for t in data["tensors"]} == {"equal"}
    sent = hub.log.sent(hub.path("org/model", "model.pt"))
    # The tensors once each (a record's first bytes come with its local header's check),
    # and the structure's blocks.
    assert tensor_bytes <= sent <= tensor_bytes * 5 // 4
    assert f"({sent:,} bytes)" in err


def test_values_none_true_and_false(hub, served, tmp_path: Path) -> None:
    url, local, _ = served
    other = tmp_path / "other.pt"
    torch.save({k: v + 1 if v.is_floating_point() else v for k, v in _state_dict().items()}, other)
    expected = {
        (local, other, None): True,
        (local, other, True): True,
        (local, other, False): False,
        (url, other, None): False,
        (other, url, None): False,
        (url, other, True): True,
        (url, other, False): False,
    }
    for (a, b, values), compared in expected.items():
        report = diff(a, b, values=values)
        assert report.values_compared is compared, (a, b, values)
        assert ("value" in report.found()) is compared, (a, b, values)
        statuses = {t.status for t in report.tensors}
        assert statuses == ({"differ", "equal"} if compared else {"unchecked"}), statuses


def test_a_url_against_a_different_checkpoint(hub, tmp_path: Path) -> None:
    """Missing and unexpected keys, and the rewrite that explains them: its command is for
    the local side, since the rewrites read local files."""
    wrapped, plain = tmp_path / "ddp.pt", tmp_path / "plain.pt"
    torch.save(_state_dict("module."), wrapped)
    torch.save(_state_dict(), plain)
    url = hub.put("org/ddp", "ddp.pt", wrapped)
    remote, local = diff(url, plain), diff(wrapped, plain, values=False)
    assert (remote.missing, remote.unexpected) == (local.missing, local.unexpected)
    assert len(remote.unexpected) == 14
    (best, *_) = remote.suggestions
    assert best.description == local.suggestions[0].description == "stripping 'module.'"
    assert (best.resolved, best.of) == (14, 14)
    assert best.command == "" and url not in best.text()
    assert best.inverse_command.startswith(f"ckpt add-module {plain}")
    assert "download" in best.note
    assert diff(url, plain, align=True, values=True).identical
    reverse = diff(plain, url)
    assert reverse.suggestions[0].command.startswith(f"ckpt add-module {plain}")
    assert reverse.suggestions[0].inverse_command == ""


def test_a_sharded_repo_against_its_local_folder(hub, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_torch_state_dict(_state_dict(), folder, max_shard_size="400KB")
    for file in folder.iterdir():
        hub.put("org/sharded", file.name, file)
    report = diff("hf://org/sharded", folder, values=True)
    assert report.identical and report.a.format == "hf-sharded" and len(report.tensors) == 14


def test_a_diff_of_files_without_values_needs_no_torch(hub, served, tmp_path: Path) -> None:
    url, local, _ = served
    proc = without_torch(CKPT, "diff", "--json", url, local, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert not data["values_compared"] and not data["missing"] and not data["unexpected"]
    proc = without_torch(CKPT, "diff", "--no-values", local, local, cwd=tmp_path)
    assert proc.returncode == 0 and "values: not compared" in proc.stdout, proc.stderr
    proc = without_torch(CKPT, "diff", "--values", url, local, cwd=tmp_path)
    assert proc.returncode == 2 and "ckpt diff needs torch" in proc.stderr


@pytest.mark.parametrize("case", ["404", "401", "timeout", "refused"])
def test_failures_to_read_give_one_line_and_an_exit_code(
    hub, dead_ends, monkeypatch, served, case
) -> None:
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "1")
    _, local, _ = served
    hub.gated["org/model"] = "secret"
    url, code, words = {
        "404": ("hf://org/none/model.pt", 2, "not found"),
        "401": ("hf://org/model/model.pt", 8, "HF_TOKEN"),
        "timeout": (f"{dead_ends.stalled}/model.pt", 8, "CKPT_REMOTE_TIMEOUT"),
        "refused": (f"{dead_ends.refused}/model.pt", 8, "could not connect"),
    }[case]
    _, out, err = run_ckpt("diff", str(local), url, code=code)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err
