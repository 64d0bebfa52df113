"""Checkpoints read where they live: ``ckpt inspect`` and ``extract`` on URLs, against real
servers started by the suite, compared with the same command on the downloaded file."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file

from tests.helpers.cli import run_ckpt
from tests.helpers.committed import fixture_path

# What a remote inspect may cost at most, whatever the file's size.
MAX_REQUESTS = 8
MAX_BYTES = 4 << 20


def _state_dict(tensors: int = 24, width: int = 32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {
        f"model.layers.{i}.weight": torch.randn(width, width, generator=gen) for i in range(tensors)
    }
    sd["model.embed.weight"] = torch.randn(100, width, generator=gen)
    sd["model.norm.num_batches_tracked"] = torch.tensor(3)
    return sd


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same state dict as a .pt, a legacy .bin, a .safetensors and a sharded folder."""
    folder = tmp_path_factory.mktemp("local")
    sd = _state_dict()
    torch.save(sd, folder / "model.pt")
    torch.save(sd, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    save_file(sd, folder / "model.safetensors")
    sharded = folder / "sharded"
    sharded.mkdir()
    save_torch_state_dict(sd, sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    return {
        "pt": folder / "model.pt",
        "bin": folder / "pytorch_model.bin",
        "safetensors": folder / "model.safetensors",
        "sharded": sharded,
    }


def _inspect_json(target: str | Path) -> dict:
    code, out, err = run_ckpt("inspect", "--json", str(target))
    assert code == 0, err
    data = json.loads(out)
    data.pop("path")
    return data


@pytest.mark.parametrize("kind", ["pt", "bin", "safetensors"])
def test_inspect_hf_file_equals_the_downloaded_file(hub, local, kind):
    name = local[kind].name
    url = hub.put("org/model", name, local[kind])
    assert _inspect_json(url) == _inspect_json(local[kind])
    path = hub.path("org/model", name)
    assert 1 <= hub.log.requests(path) <= MAX_REQUESTS
    assert hub.log.sent(path) <= MAX_BYTES


def test_inspect_sharded_repo_equals_the_downloaded_folder(hub, local):
    for file in local["sharded"].iterdir():
        hub.put("org/sharded", file.name, file)
    remote = _inspect_json("hf://org/sharded")
    assert remote == _inspect_json(local["sharded"])
    assert len(remote["shards"]) > 1
    # The index and one header per shard, after two misses: config.json, model.safetensors.
    assert hub.log.requests() <= 3 + len(remote["shards"])
    assert len([h for h in hub.log.hits if h.status != 404]) <= 1 + len(remote["shards"])


def test_inspect_http_and_s3_urls(hub, s3, local):
    expected = _inspect_json(local["pt"])
    assert _inspect_json(hub.put_file("model.pt", local["pt"])) == expected
    assert _inspect_json(s3.put("runs/model.pt", local["pt"])) == expected


def test_verbose_reports_requests_and_bytes(hub, local):
    url = hub.put("org/model", "model.safetensors", local["safetensors"])
    code, _, err = run_ckpt("inspect", "--verbose", url)
    assert code == 0, err
    path = hub.path("org/model", "model.safetensors")
    hub.log.settle()
    assert f"remote: {hub.log.requests(path)} request" in err
    assert f"({hub.log.sent(path):,} bytes)" in err


def test_many_tensors_cost_a_few_requests(hub, tmp_path):
    """A .pt of 350 tensors (its pickle, its central directory, its end records) and a
    safetensors file of as many: bytes moved stay far below the file's size."""
    sd = {f"blocks.{i // 10}.layer{i % 10}.weight": torch.zeros(64, 512) for i in range(350)}
    for name in ("many.pt", "many.safetensors"):
        target = tmp_path / name
        torch.save(sd, target) if name.endswith(".pt") else save_file(sd, target)
        url = hub.put("org/many", name, target)
        assert _inspect_json(url) == _inspect_json(target)
        path = hub.path("org/many", name)
        assert hub.log.requests(path) <= MAX_REQUESTS
        assert hub.log.sent(path) <= MAX_BYTES < target.stat().st_size


def test_server_ignoring_range_is_refused(no_range, tmp_path):
    """Answered 200 with the whole body of a file larger than the first range asked for."""
    target = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(1 << 20)}, target)
    url = no_range.put("model.pt", target)
    code, out, err = run_ckpt("inspect", url, code=None)
    assert code == 8 and out == ""
    assert "Range" in err and "download" in err
    assert len(err.strip().splitlines()) == 1


def test_a_lying_header_is_refused_before_anything_large_is_fetched(hub, tmp_path):
    """A safetensors header that claims 90 MB in a small file: refused from the size the
    first response gave, with nothing more requested."""
    target = tmp_path / "liar.safetensors"
    target.write_bytes(struct.pack("<Q", 90_000_000) + b'{"a":' + bytes(1000))
    url = hub.put("org/liar", "model.safetensors", target)
    _, _, err = run_ckpt("inspect", url, code=4)
    assert "90000000" in err
    assert hub.log.requests(hub.path("org/liar", "model.safetensors")) == 1


def test_extract_fetches_only_the_kept_records(hub, tmp_path):
    sd = {"embed.weight": torch.randn(256, 64), "body.weight": torch.randn(2048, 512)}
    src = tmp_path / "model.pt"
    torch.save(sd, src)
    url = hub.put("org/big", "model.pt", src)
    out = tmp_path / "embed.safetensors"
    code, _, err = run_ckpt("extract", url, str(out), "--prefix", "embed.")
    assert code == 0, err
    from safetensors.torch import load_file

    assert torch.equal(load_file(out)["embed.weight"], sd["embed.weight"])
    sent = hub.log.sent(hub.path("org/big", "model.pt"))
    assert sent < sd["body.weight"].nbytes // 4


def test_slim_weights_only_from_a_url_fetches_only_the_weights(hub, tmp_path):
    """A trainer checkpoint: the model's weights cast to bf16, the optimizer's moments
    (twice the weights' bytes) never fetched."""
    model = {f"layers.{i}.weight": torch.randn(256, 256) for i in range(4)}
    moments = {
        i: {"exp_avg": torch.randn(256, 256), "exp_avg_sq": torch.rand(256, 256)} for i in range(4)
    }
    src = tmp_path / "trainer.pt"
    torch.save({"model": model, "optimizer": {"state": moments}, "epoch": 3}, src)
    url = hub.put("org/run", "trainer.pt", src)
    out = tmp_path / "weights.safetensors"
    code, _, err = run_ckpt("slim", url, str(out), "--dtype", "bf16", "--weights-only")
    assert code == 0, err
    from safetensors.torch import load_file

    got = load_file(out)
    assert set(got) == set(model)
    for key, tensor in model.items():
        assert torch.equal(got[key], tensor.to(torch.bfloat16)), key
    weights = sum(t.nbytes for t in model.values())
    assert hub.log.sent(hub.path("org/run", "trainer.pt")) < weights + (1 << 20)


def test_errors_are_one_line_with_an_exit_code(hub, dead_ends, monkeypatch, local):
    """404, 401 (naming HF_TOKEN), a timeout and a refused connection: one line each."""
    hub.put("org/gated", "model.pt", local["pt"])
    hub.gated["org/gated"] = "secret"
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "0.5")
    cases = [
        ("hf://org/missing/model.pt", 2, "404"),
        ("hf://org/gated/model.pt", 8, "HF_TOKEN"),
        (f"{dead_ends.stalled}/model.pt", 8, "CKPT_REMOTE_TIMEOUT"),
        (f"{dead_ends.refused}/model.pt", 8, "refused"),
    ]
    for url, code, words in cases:
        _, out, err = run_ckpt("inspect", url, code=code)
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert words in err, err
    monkeypatch.setenv("HF_TOKEN", "secret")
    assert _inspect_json("hf://org/gated/model.pt") == _inspect_json(local["pt"])


def test_redirects_to_a_cdn_are_followed(hub, local):
    url = hub.put("org/model", "model.safetensors", local["safetensors"])
    hub.redirect = True
    assert _inspect_json(url) == _inspect_json(local["safetensors"])
    assert any("/cdn/" in hit.path for hit in hub.log.for_path())


def test_verbose_counts_every_request_of_a_redirected_file(hub, tmp_path):
    """A file the Hub redirects to its CDN is resolved once: its start and its end cost the
    redirect and two ranges at the CDN, and --verbose counts the three."""
    torch.save({f"w{i}": torch.zeros(256, 256) for i in range(12)}, tmp_path / "big.pt")
    url = hub.put("org/model", "big.pt", tmp_path / "big.pt")
    hub.redirect = True
    code, _, err = run_ckpt("inspect", "--verbose", url)
    assert code == 0, err
    assert hub.log.requests(hub.path("org/model", "big.pt")) == 1
    assert hub.log.requests() == 3 and "remote: 3 requests" in err, err
    assert f"({hub.log.sent():,} bytes)" in err


def test_a_broken_local_header_is_found_when_the_record_is_read(hub, tmp_path):
    """Remotely, inspect trusts the central directory; the local header of a record is
    checked when its bytes are read, and refused then as torch refuses it."""
    src = tmp_path / "model.pt"
    torch.save({"a": torch.ones(4096), "b": torch.zeros(4096)}, src)
    data = bytearray(src.read_bytes())
    header = data.rindex(b"PK\x03\x04", 0, data.index(b"model/data/1"))
    data[header + 3] = 0x05  # its local header's signature
    src.write_bytes(bytes(data))
    url = hub.put("org/broken", "model.pt", src)
    info = _inspect_json(url)
    assert [t["name"] for t in info["tensors"]] == ["a", "b"]
    run_ckpt("extract", url, str(tmp_path / "a.pt"), "--prefix", "a", code=0)
    _, _, err = run_ckpt("extract", url, str(tmp_path / "b.pt"), "--prefix", "b", code=4)
    assert "local header" in err
    with pytest.raises(RuntimeError):
        torch.load(src, weights_only=True)
    run_ckpt("inspect", str(src), code=4)  # locally every local header is read at once


def test_a_rezipped_archive_is_extracted_from_a_url(hub, tmp_path):
    """Compressed records (an archive re-zipped by a zip tool; torch reads it) are fetched
    and inflated in bounded pieces."""
    src, rezipped = tmp_path / "model.pt", tmp_path / "deflated.pt"
    torch.save({"a": torch.arange(1000.0), "b": torch.ones(10)}, src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(rezipped, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    url = hub.put("org/zipped", "model.pt", rezipped)
    assert _inspect_json(url) == _inspect_json(rezipped)
    out = tmp_path / "a.pt"
    run_ckpt("extract", url, str(out), "--prefix", "a", code=0)
    assert torch.equal(torch.load(out, weights_only=True)["a"], torch.arange(1000.0))
    # A .safetensors output reads spans: each record fetched and inflated into a copy.
    from safetensors.torch import load_file

    run_ckpt("extract", url, str(out.with_suffix(".safetensors")), "--prefix", "a", code=0)
    got = load_file(out.with_suffix(".safetensors"))
    assert torch.equal(got["a"], torch.arange(1000.0))


def test_a_file_replaced_while_extracted_is_refused_not_mixed(hub, tmp_path):
    """The server overwrites the file after its first request (a re-upload of the same
    size): extract and inspect refuse (exit 8) instead of reading old and new bytes as one."""
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    for seed, path in ((0, old), (1, new)):
        gen = torch.Generator().manual_seed(seed)
        save_file({f"w.{i}": torch.randn(512, 512, generator=gen) for i in range(6)}, path)
    assert old.stat().st_size == new.stat().st_size
    url = hub.put("org/moving", "model.safetensors", old)
    hub.replace_later("org/moving", "model.safetensors", new)
    out = tmp_path / "out.safetensors"
    _, _, err = run_ckpt("extract", url, out, "--prefix", "w", "-q", code=8)
    assert "the remote file changed while it was read" in err and not out.exists()
    assert len(err.strip().splitlines()) == 1, err
    grown = tmp_path / "grown.pt"
    torch.save({f"w{i}": torch.zeros(1 << 16) for i in range(8)}, grown)
    url = hub.put("org/moving", "model.pt", grown)
    hub.replace_later("org/moving", "model.pt", grown.read_bytes() + bytes(1000))
    _, _, err = run_ckpt("inspect", url, code=8)
    assert "the remote file changed while it was read" in err, err


@pytest.mark.parametrize("name", ["c7-b020549112.pt", "c1-5a4effd25b.pt", "c8-3e0e334096.pt"])
def test_a_malformed_file_is_named_by_its_url_as_a_local_one_by_its_path(hub, name):
    """Errors of the pickle reader, which knows no file name, name the URL as they name a
    local path: the same one line, the URL where the path was."""
    path = Path(__file__).parents[2] / "fuzz" / "regressions" / name
    url = hub.put("org/broken", name, path)
    code, _, local = run_ckpt("inspect", path, code=None)
    assert code in (4, 5) and f"{str(path)!r}: " in local, local
    _, _, remote = run_ckpt("inspect", url, code=code)
    assert remote == local.replace(str(path), url)
    _, _, both = run_ckpt("diff", fixture_path("model.pt"), url, code=code)
    assert f"{url!r}: " in both


@pytest.mark.parametrize("shard", ["../model.safetensors", "/etc/passwd", "sub/../x", "a\\b"])
def test_an_index_naming_a_shard_outside_its_folder_is_corrupt_as_locally(hub, tmp_path, shard):
    """The index is the file's content, not the user's argument: exit 4 by URL as by path,
    with no request for the shard."""
    folder = tmp_path / "idx"
    folder.mkdir()
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": shard}}))
    url = hub.put("org/idx", index.name, index)
    run_ckpt("inspect", index, code=4)
    for target in (url, "hf://org/idx"):
        _, out, err = run_ckpt("inspect", target, code=4)
        assert out == "" and "shards must lie beside the index" in err, err
    _, _, err = run_ckpt("scan", "hf://org/idx", code=4)
    assert "shards must lie beside the index" in err, err
    assert {h.path for h in hub.log.for_path()} <= {
        hub.path("org/idx", name) for name in (index.name, "model.safetensors", "config.json")
    }


@pytest.mark.parametrize(
    "url, timeout, words",
    [
        ("http://[::1/x.pt", None, "Invalid IPv6 URL"),
        ("http://[zz]/x.pt", None, "'zz' does not appear to be an IPv4 or IPv6 address"),
        ("https:///x.pt", None, "names no host"),
        ("http://127.0.0.1:99999/x.pt", None, "Port out of range"),
        ("hf://org/model/model.pt", "inf", "CKPT_REMOTE_TIMEOUT='inf'"),
        ("hf://org/model/model.pt", "1e300", "CKPT_REMOTE_TIMEOUT='1e300'"),
        ("hf://org/model/model.pt", "nan", "CKPT_REMOTE_TIMEOUT='nan'"),
        ("hf://org/model/model.pt", "-1", "CKPT_REMOTE_TIMEOUT='-1'"),
    ],
)
def test_a_bad_url_or_timeout_is_one_line_and_exit_2(hub, monkeypatch, url, timeout, words):
    """The value at fault and what to write instead, never a traceback, for every command
    that reads URLs; nothing is requested."""
    if timeout is not None:
        monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", timeout)
    expected = "write http(s)://HOST/PATH" if timeout is None else "at most 86400"
    for command in (("inspect", url), ("scan", url), ("diff", url, url)):
        _, out, err = run_ckpt(*command, code=2)
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert words in err and expected in err, err
    assert hub.log.requests() == 0


@pytest.mark.parametrize("status", [404, 500])
def test_a_signed_cdn_url_is_never_shown(hub, local, status):
    """The Hub redirects to a CDN URL whose query is a short-lived credential: a failure
    there names the CDN's host and path, never its query."""
    url = hub.put("org/model", "model.pt", local["pt"])
    hub.redirect = True
    hub.signature = "?Expires=1&Signature=SIGSECRET&Key-Pair-Id=K"
    hub.statuses["/cdn/models/org/model/main/model.pt"] = status
    _, out, err = run_ckpt("inspect", url, code=2 if status == 404 else 8)
    assert f"from http://localhost:{hub.port}/cdn/models/org/model/main/model.pt" in err, err
    assert "SIGSECRET" not in err and "Expires" not in err and out == ""


def test_a_password_in_a_url_is_sent_never_shown(hub, local):
    """``https://user:password@host/...``: sent as Basic auth to that host, shards of a
    folder included, and absent from the JSON and every message, which show *** for it."""
    good = hub.put_file("model.pt", local["pt"]).replace("://", "://me:PASSW0RD@")
    for file in local["sharded"].iterdir():
        hub.put_file(f"sharded/{file.name}", file)
    folder = f"{hub.url}/files/sharded/".replace("://", "://me:PASSW0RD@")
    missing = f"{hub.url}/files/none.pt".replace("://", "://me:PASSW0RD@")
    runs = [
        run_ckpt("inspect", "--json", good),
        run_ckpt("inspect", "--json", folder),
        run_ckpt("scan", "--json", good),
        run_ckpt("scan", "--json", folder),
        run_ckpt("diff", good, folder, "--no-values", code=None),
        run_ckpt("inspect", missing, code=2),
        run_ckpt("scan", "--json", missing, code=2),
    ]
    for _, out, err in runs:
        assert "PASSW0RD" not in out + err, out + err
    assert json.loads(runs[0].stdout)["path"] == good.replace("me:PASSW0RD@", "***@")
    assert "***@127.0.0.1" in runs[-2].stderr
    hits = hub.log.for_path()
    assert len(hits) > len(list(local["sharded"].iterdir()))
    assert all(h.authorization and h.authorization.startswith("Basic ") for h in hits)


def test_a_sharded_checkpoint_keeps_no_cache_per_shard(hub, tmp_path):
    """Each shard's first bytes are dropped once its header is read: what the range caches
    hold after opening stays within one file's cache however many shards the index names."""
    from ckpt_tools.io.remote import RemoteSession
    from ckpt_tools.io.remote.checkpoint import open_url
    from ckpt_tools.io.remote.rangefile import CACHE_BYTES

    folder = tmp_path / "many"
    folder.mkdir()
    sd = {f"layers.{i}.weight": torch.zeros(64, 64) for i in range(48)}
    save_torch_state_dict(sd, folder, max_shard_size="40KB")
    shards = list(folder.glob("*.safetensors"))
    assert len(shards) >= 20
    for file in folder.iterdir():
        hub.put("org/many", file.name, file)
    with RemoteSession() as session:
        ckpt = open_url("hf://org/many", session=session)
        assert len(ckpt.remote) == len(shards) + 1
        shard_files = [f for url, f in ckpt.remote.items() if url.endswith(".safetensors")]
        assert sum(f.cached_bytes for f in shard_files) == 0
        assert sum(f.cached_bytes for f in ckpt.remote.values()) <= CACHE_BYTES
    assert _inspect_json("hf://org/many") == _inspect_json(folder)


def test_a_served_git_lfs_pointer_is_not_told_to_be_pulled(hub, tmp_path):
    # There is no repository here to pull into: the server holds the pointer itself.
    url = hub.put("org/pointer", "model.pt", fixture_path("lfs_pointer.pt"))
    _, _, err = run_ckpt("inspect", url, code=4)
    assert "is a git-lfs pointer" in err and "upload it with git-lfs" in err
    assert "git lfs pull" not in err
