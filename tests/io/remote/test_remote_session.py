"""RemoteSession: what it opens and refuses, folder URLs searched in transformers' order
(config.json's ``transformers_weights`` first; each miss one request, counted on both
sides), and the remote extra missing.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from ckpt_tools.errors import (
    EXIT_USAGE,
    CheckpointNotFoundError,
    MissingExtraError,
    RemoteAccessError,
    UnsupportedFormatError,
    UsageError,
)
from ckpt_tools.io.remote import RemoteSession, TransferStats
from ckpt_tools.io.remote.urls import FOLDER_FILES
from tests.helpers.cli import modules_loaded_by, run_ckpt
from tests.helpers.committed import fixture_path
from tests.helpers.servers import HubServer, S3Bucket


@pytest.mark.parametrize("path", ["model.pt", "/abs/model.pt", "ftp://host/x.pt", "hf:/org/m"])
def test_open_refuses_what_is_not_a_url(path: str) -> None:
    with RemoteSession(timeout=1) as remote, pytest.raises(UsageError, match="not a URL"):
        remote.open(path)


@pytest.mark.parametrize("url", ["hf://org/m", "hf://org/m@v1", "https://h/runs/", "s3://b/run/"])
def test_open_refuses_a_folder(url: str) -> None:
    with RemoteSession(timeout=1) as remote, pytest.raises(UsageError, match="open_folder"):
        remote.open(url)


def test_a_folder_is_searched_in_order(hub: HubServer) -> None:
    """Only pytorch_model.bin: found after config.json and the two names before it miss."""
    hub.put("org/old", "pytorch_model.bin", b"legacy weights")
    with RemoteSession() as remote:
        name, f = remote.open_folder("hf://org/old")
        assert (name, f.url, f.read()) == (
            "pytorch_model.bin",
            "hf://org/old/pytorch_model.bin",
            b"legacy weights",
        )
    tried = ["config.json", *FOLDER_FILES[: FOLDER_FILES.index("pytorch_model.bin") + 1]]
    assert [h.path for h in hub.log.hits] == [hub.path("org/old", n) for n in tried]
    assert [h.status for h in hub.log.hits] == [404, 404, 404, 206]
    assert remote.stats == TransferStats(requests=4, bytes_received=len(b"legacy weights"))


@pytest.mark.parametrize(
    ("present", "found"),
    [
        (FOLDER_FILES, "model.safetensors"),  # from_pretrained leaves the index unread
        (("model.safetensors", "pytorch_model.bin"), "model.safetensors"),
        (("pytorch_model.bin.index.json", "pytorch_model.bin"), "pytorch_model.bin"),
        (("pytorch_model.bin.index.json",), "pytorch_model.bin.index.json"),
    ],
)
def test_the_first_present_name_wins(hub: HubServer, present: tuple[str, ...], found: str) -> None:
    for name in present:
        hub.put("org/m", name, name.encode(), revision="refs/pr/2")
    with RemoteSession() as remote:
        name, f = remote.open_folder("hf://org/m@refs/pr/2")
        assert name == found and f.read() == found.encode()
    # config.json (a 404), then each name up to the one found.
    assert hub.log.requests() == FOLDER_FILES.index(found) + 2 == remote.stats.requests


@pytest.mark.parametrize("named", ["ema/model.safetensors", "./ema/model.safetensors"])
def test_the_file_config_json_names_is_opened_before_the_usual_names(
    hub: HubServer, s3: S3Bucket, named: str
) -> None:
    config = json.dumps({"transformers_weights": named}).encode()
    hub.put("org/named", "config.json", config)
    hub.put("org/named", "model.safetensors", b"plain")
    hub.put("org/named", "ema/model.safetensors", b"ema")
    s3.put("run/config.json", config)
    s3.put("run/ema/model.safetensors", b"ema")
    with RemoteSession() as remote:
        name, f = remote.open_folder("hf://org/named")
        assert (name, f.url, f.read()) == (
            "ema/model.safetensors",
            "hf://org/named/ema/model.safetensors",
            b"ema",
        )
        assert remote.open_folder("s3://ckpts/run/")[1].read() == b"ema"
    assert hub.log.requests() == 2 == s3.server.log.requests(method="GET")


@pytest.mark.parametrize(
    ("named", "words"),
    [
        ("gone.safetensors", "which the folder does not hold"),
        ("pytorch_model.bin", "loads only a *.safetensors file"),
        ("../other/model.safetensors", "outside the folder"),
    ],
)
def test_weights_config_json_names_as_from_pretrained_refuses_them_are_refused(
    hub: HubServer, named: str, words: str
) -> None:
    hub.put("org/bad", "config.json", json.dumps({"transformers_weights": named}).encode())
    hub.put("org/bad", "model.safetensors", b"plain")
    hub.put("org/bad", "pytorch_model.bin", b"plain")
    with RemoteSession() as remote, pytest.raises(UnsupportedFormatError) as info:
        remote.open_folder("hf://org/bad")
    assert "names transformers_weights" in str(info.value) and words in str(info.value)
    assert info.value.path == "hf://org/bad"


def test_a_folder_over_plain_http_and_s3(hub: HubServer, s3: S3Bucket) -> None:
    folder = hub.put_file("run/model.safetensors", b"st").rpartition("/")[0] + "/"
    s3.put("run/pytorch_model.bin", b"pt")
    with RemoteSession() as remote:
        assert remote.open_folder(folder)[0] == "model.safetensors"
        name, f = remote.open_folder("s3://ckpts/run/")
        assert (name, f.url, f.read()) == (
            "pytorch_model.bin",
            "s3://ckpts/run/pytorch_model.bin",
            b"pt",
        )
    assert s3.server.log.requests(method="GET") == 4


def test_an_s3_folder_whose_keys_hold_a_double_slash_is_read_at_those_keys(
    s3: S3Bucket, tmp_path: Path
) -> None:
    # A prefix ending in "/" joined to another "/": the shards are at "exp1//...".
    from huggingface_hub import save_torch_state_dict

    torch = pytest.importorskip("torch")
    folder = tmp_path / "model"
    folder.mkdir()
    weights = {f"l{i}.w": torch.ones(64, 64) for i in range(3)}
    save_torch_state_dict(weights, folder, max_shard_size="20KB")
    for f in folder.iterdir():
        s3.put(f"exp1//{f.name}", f)
    local = run_ckpt("inspect", "--json", folder).stdout
    for url in ("s3://ckpts/exp1//", "s3://ckpts/exp1//model.safetensors.index.json"):
        got = json.loads(run_ckpt("inspect", "--json", url).stdout)
        assert got["tensors"] == json.loads(local)["tensors"] and got["format"] == "hf-sharded"


@pytest.mark.parametrize(
    ("name", "fixture"),
    [("model.safetensors", "model.safetensors"), ("pytorch_model.bin", "model.pt")],
)
def test_a_folder_of_one_weight_file_is_reported_as_the_same_local_folder(
    hub: HubServer, tmp_path: Path, name: str, fixture: str
) -> None:
    """``inspect`` of a folder URL that holds one weight file: ``hf-sharded``, that file its
    one shard, as the folder inspected locally; its path is the folder URL as given."""
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copyfile(fixture_path(fixture), folder / name)
    _, out, _ = run_ckpt("inspect", "--json", folder)
    local = json.loads(out)
    assert (local["format"], local["shards"], local.pop("path")) == (
        "hf-sharded",
        [name],
        str(folder),
    )
    http = hub.put_file(f"one/{name}", folder / name).rpartition("/")[0] + "/"
    hub_repo = hub.put("org/one", name, folder / name).rpartition("/")[0]
    for url in (http, hub_repo):
        _, out, _ = run_ckpt("inspect", "--json", url)
        remote = json.loads(out)
        assert remote.pop("path") == url
        assert remote == local


def test_an_empty_folder_names_what_was_tried(hub: HubServer) -> None:
    hub.put("org/empty", "README.md", b"# nothing here")
    with RemoteSession() as remote, pytest.raises(CheckpointNotFoundError) as info:
        remote.open_folder("hf://org/empty")
    message = str(info.value)
    assert message.startswith("hf://org/empty: no checkpoint in this folder (tried ")
    assert all(name in message for name in FOLDER_FILES)
    assert info.value.exit_code == EXIT_USAGE and info.value.path == "hf://org/empty"
    assert hub.log.requests() == 5 == remote.stats.requests  # config.json, then the four


def test_a_folder_of_a_variant_is_read_through_the_file_named(hub: HubServer) -> None:
    # A URL folder is not listed: the refusal says to name the file, and naming it reads it.
    from ckpt_tools import inspect

    url = hub.put("org/fp16", "model.fp16.safetensors", fixture_path("model.safetensors"))
    with RemoteSession() as remote, pytest.raises(CheckpointNotFoundError) as info:
        remote.open_folder("hf://org/fp16")
    assert "name the weights file in the URL" in str(info.value)
    assert inspect(url).tensors


def test_a_refused_token_stops_the_search(hub: HubServer) -> None:
    hub.put("org/gated", "pytorch_model.bin", b"w")
    hub.gated["org/gated"] = "hf_granted"
    with RemoteSession() as remote, pytest.raises(RemoteAccessError, match="HF_TOKEN"):
        remote.open_folder("hf://org/gated")
    assert hub.log.requests() == 1


@pytest.mark.parametrize(
    ("module", "url"),
    [("httpx", "https://h/x.pt"), ("httpx", "hf://org/m/x.pt"), ("botocore", "s3://b/x.pt")],
)
def test_without_the_remote_extra(
    remote_env: Path, monkeypatch: pytest.MonkeyPatch, module: str, url: str
) -> None:
    """The package missing (an import that fails, as in an environment without it)."""
    for name in [module, *(m for m in sys.modules if m.startswith(f"{module}."))]:
        monkeypatch.setitem(sys.modules, name, None)
    with RemoteSession(timeout=1) as remote, pytest.raises(MissingExtraError) as info:
        remote.open(url)
    err = info.value
    assert f"needs {module}: pip install 'ckpt_tools[remote]'" in str(err)
    assert str(err).startswith(f"reading {url.partition(':')[0]}:// URLs needs"), str(err)
    assert isinstance(err, ImportError) and err.name == module and err.exit_code == EXIT_USAGE


def test_importing_the_package_imports_no_client() -> None:
    """httpx and botocore load when a URL of theirs is opened, not before."""
    assert modules_loaded_by("import ckpt_tools.io.remote", ["httpx", "botocore"]) == []
