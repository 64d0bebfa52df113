"""``scan`` and ``ckpt scan`` on URLs: the verdict of the downloaded file, against real servers.

Every file of the malicious corpus and of the committed fixtures is served by the suite's
Hub look-alike (``tests/helpers/servers.py``) and scanned by URL; its report must equal the
local file's, path aside. Request and byte counts are the server's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import save_file

from ckpt_tools import scan
from ckpt_tools.formats.zip.directory import read_zip_directory
from ckpt_tools.io.remote import TransferStats
from tests.helpers.cli import run_ckpt
from tests.helpers.committed import fixture_files, fixture_path
from tests.helpers.scan_corpus import MALICIOUS

# Read member by member: refused for URLs (scanned from a local copy).
TAR = {
    "tar_pickle.pt",
    "tar_pickle_symlink.pt",
    "tar_storages.pt",
    "tar_storage_item.pt",
    "tar_storage_views.pt",
    "tar_tensor_item.pt",
    "tar_format.pt",
}


# No directory lists its records: searched by their local headers in a local file only.
LOCAL_SEARCH = {"truncated.pt"}


def _same_path(data: dict, url: str, local: Path) -> dict:
    """``data`` with the URL written as the local path (paths are quoted in messages)."""
    return json.loads(json.dumps(data).replace(url, str(local)))


def test_every_corpus_file_and_fixture_gets_the_local_report(hub, corpus) -> None:
    entries, markers = corpus
    paths = [e.path for e in entries if e.path.name not in TAR] + fixture_files(exclude=TAR)
    urls = [hub.put("org/corpus", p.name, p) for p in paths]
    remote, local = scan(urls), scan(paths)
    assert len(remote.files) == len(paths) and remote.skipped == local.skipped == ()
    for url, path, got, want in zip(urls, paths, remote.files, local.files):
        assert got.path == url
        got_json, want_json = _same_path(got.to_json(), url, path), want.to_json()
        if path.name in LOCAL_SEARCH:  # (its records found by their local headers locally)
            assert want_json.pop("pickles") > got_json.pop("pickles") == 0
        if "git-lfs pointer" in (want_json.get("error") or ""):  # served: none to pull
            assert got_json.pop("error").endswith("upload it with git-lfs")
            assert want_json.pop("error").endswith("to fetch the real file")
        assert got_json == want_json, path.name
        assert got.transfer.requests >= 1
    assert {f.verdict for f in remote.files} == {"dangerous", "clean", "nonstandard", "unreadable"}
    assert remote.transfer.requests == hub.log.requests()
    assert remote.transfer.bytes_received == hub.log.sent()
    assert not list(markers.iterdir())  # nothing fetched was run


@pytest.mark.parametrize(
    "name", ["os_system.pkl", "zip_reduce_p2.pt", "zip_deflated.pt", "legacy_main.pt", "evil.pt"]
)
def test_the_command_gives_a_dangerous_url_the_local_json_and_exit_code(hub, corpus, name) -> None:
    entries, markers = corpus
    path = next((e.path for e in entries if e.path.name == name), None) or fixture_path(name)
    url = hub.put("org/evil", name, path)
    remote = run_ckpt("scan", "--json", url, code=1)
    local = run_ckpt("scan", "--json", path, code=1)
    assert _same_path(json.loads(remote.stdout), url, path) == json.loads(local.stdout)
    assert json.loads(remote.stdout)["verdict"] == "dangerous"
    assert not list(markers.iterdir())


def test_s3_and_plain_http_urls(hub, s3, corpus) -> None:
    entries, _ = corpus
    evil = next(e for e in entries if e.kind == MALICIOUS and e.path.suffix == ".pt")
    for url in (s3.put(f"runs/{evil.path.name}", evil.path), hub.put_file("x.pt", evil.path)):
        (found,) = scan(url).files
        assert found.verdict == "dangerous" and found.format == "torch-zip", url


def test_sarif_names_a_url_by_the_url_without_its_credentials(hub, s3) -> None:
    """A SARIF artifactLocation URI is the URL itself (its '//' kept, as a path's would be
    folded), shown without a password or a query's values."""
    evil = fixture_path("evil.pt")
    url = hub.put_file("evil.pt", evil)
    secret = url.replace("://", "://me:PASSW0RD@") + "?token=QSECRET"
    given = {
        url: url,
        hub.put("org/repo", "evil.pt", evil): "hf://org/repo/evil.pt",
        s3.put("runs/evil.pt", evil): "s3://ckpts/runs/evil.pt",
        secret: url.replace("://", "://***@") + "?token=***",
    }
    for target, shown in given.items():
        _, out, err = run_ckpt("scan", "--format", "sarif", target, code=1)
        (run,) = json.loads(out)["runs"]
        uris = {
            loc["physicalLocation"]["artifactLocation"]["uri"]
            for result in run["results"]
            for loc in result["locations"]
        }
        assert uris == {shown}, (target, uris)
        assert "PASSW0RD" not in out + err and "QSECRET" not in out + err


def _local_header_renamed(src: Path, dst: Path, record: str) -> None:
    """``src`` with one record's name changed in its local header only (same length)."""
    data = bytearray(src.read_bytes())
    fd_entries = read_zip_directory(str(src), _Bytes(bytes(data)), len(data))
    entry = next(e for e in fd_entries if e.name.endswith(record))
    at = entry.header_offset + 30 + len(entry.raw_name) - 1
    data[at] = ord("Z")
    dst.write_bytes(bytes(data))


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data, self.size = data, len(data)

    def pread(self, count: int, offset: int) -> bytes:
        return self.data[offset : offset + count]


def test_a_local_header_checked_only_when_reached_gives_the_local_verdict(hub, tmp_path) -> None:
    """A remote read trusts the directory; the scan reads every record's local header, and
    one that disagrees makes the archive the one our reader refuses, as it is locally."""
    good = tmp_path / "good.pt"
    torch.save({f"w{i}": torch.full((4,), float(i)) for i in range(4)}, good)
    bad = tmp_path / "bad.pt"
    _local_header_renamed(good, bad, "data/3")
    url = hub.put("org/bad", "bad.pt", bad)
    (remote,) = scan(url).files
    (local,) = scan(bad).files
    assert local.verdict == "unreadable" and "local header" in (local.error or "")
    assert _same_path(remote.to_json(), url, bad) == local.to_json()


def test_a_folder_url_scans_the_weight_files_a_loader_takes(hub, tmp_path, corpus) -> None:
    """A sharded repo: each shard its index names, as the local folder scan finds them; the
    index is skipped. A pytorch_model.bin beside a model.safetensors is scanned too."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    sd = {f"layers.{i}.weight": torch.randn(32, 32) for i in range(8)}
    save_torch_state_dict(sd, folder, max_shard_size="10KB")
    for file in folder.iterdir():
        hub.put("org/sharded", file.name, file)
    remote = scan("hf://org/sharded")
    local = scan(folder)
    assert len(remote.files) > 1 and all(f.verdict == "clean" for f in remote.files)
    got = json.loads(json.dumps(remote.to_json()).replace("hf://org/sharded", str(folder)))
    assert got == local.to_json()
    entries, _ = corpus
    evil = next(e.path for e in entries if e.path.name == "zip_reduce_p2.pt")
    hub.put("org/both", "model.safetensors", fixture_path("model.safetensors"))
    hub.put("org/both", "pytorch_model.bin", evil)
    _, out, _ = run_ckpt("scan", "--json", "hf://org/both", code=1)
    verdicts = {Path(f["path"]).name: f["verdict"] for f in json.loads(out)["files"]}
    assert verdicts == {"model.safetensors": "clean", "pytorch_model.bin": "dangerous"}


def test_a_folder_url_scans_the_file_its_config_names(hub, tmp_path, corpus) -> None:
    """config.json's transformers_weights names the file from_pretrained loads, whatever
    else the folder holds: it is scanned (a clean model.safetensors beside it says nothing of
    it), and a name the folder does not hold is refused as inspect refuses it."""
    entries, _ = corpus
    evil = next(e.path for e in entries if e.path.name == "zip_reduce_p2.pt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"transformers_weights": "adapter_model.bin"}))
    hub.put("org/named", "model.safetensors", fixture_path("model.safetensors"))
    hub.put("org/named", "adapter_model.bin", evil)
    hub.put("org/named", "config.json", config)
    _, out, _ = run_ckpt("scan", "--json", "hf://org/named", code=1)
    verdicts = {Path(f["path"]).name: f["verdict"] for f in json.loads(out)["files"]}
    assert verdicts == {"adapter_model.bin": "dangerous", "model.safetensors": "clean"}
    config.write_text(json.dumps({"transformers_weights": "ema.safetensors"}))
    hub.put("org/unheld", "model.safetensors", fixture_path("model.safetensors"))
    hub.put("org/unheld", "config.json", config)
    _, _, err = run_ckpt("scan", "hf://org/unheld", code=4)
    assert "names transformers_weights 'ema.safetensors', which the folder does not hold" in err
    _, _, inspected = run_ckpt("inspect", "hf://org/unheld", code=4)
    assert inspected == err


def test_verbose_counts_each_file_a_folder_url_leads_to_as_the_server_did(hub, tmp_path) -> None:
    """``scan -v`` of two folder URLs: each file's line counts its own requests and bytes,
    the first one (made by the folder's search) included; the total adds the misses."""
    save_file({"w": torch.ones(4)}, tmp_path / "model.safetensors")
    torch.save({f"x{i}": torch.zeros(1 << 14) for i in range(8)}, tmp_path / "pytorch_model.bin")
    names = (("a", "model.safetensors"), ("b", "pytorch_model.bin"))
    files = [hub.put_file(f"{folder}/{name}", tmp_path / name) for folder, name in names]
    folders = [url.rpartition("/")[0] + "/" for url in files]
    _, _, err = run_ckpt("scan", "--verbose", *folders, code=0)
    for url in files:
        path = url.removeprefix(hub.url)
        cost = TransferStats(hub.log.requests(path), hub.log.sent(path))
        assert f"remote: {url}: {cost}\n" in err, err
    assert f"remote: {TransferStats(hub.log.requests(), hub.log.sent())}" in err, err
    assert hub.log.requests(files[1].removeprefix(hub.url)) > 1
    hub.log.clear()
    report = scan(folders)
    for url, got in zip(files, report.files, strict=True):
        path = url.removeprefix(hub.url)
        assert (got.path, got.transfer) == (
            url,
            TransferStats(hub.log.requests(path), hub.log.sent(path)),
        )


def test_tar_dcp_and_deepspeed_urls_are_refused_with_the_fix(hub) -> None:
    url = hub.put("org/old", "tar_format.pt", fixture_path("tar_format.pt"))
    hub.put("org/dcp", ".metadata", b"\x80\x04N.")
    hub.put("org/dcp", "__0_0.distcp", b"PK")
    hub.put("org/ds", "latest", b"global_step10")
    for target, what in ((url, "torch-tar"), ("hf://org/dcp", "DCP"), ("hf://org/ds", "DeepSpeed")):
        _, out, err = run_ckpt("scan", target, code=4)
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert what in err and "download" in err and "local" in err


def test_a_scan_reads_each_record_head_never_the_tensors(hub, tmp_path) -> None:
    """One request per record (its local header and first bytes), never a tensor whole:
    the server sends a fraction of the file, and --verbose says what it sent."""
    records = 100
    src = tmp_path / "big.pt"
    torch.save({f"layer{i}.weight": torch.zeros(128, 512) for i in range(records)}, src)
    url = hub.put("org/big", "big.pt", src)
    _, out, err = run_ckpt("scan", "--verbose", url, code=0)
    assert "clean" in out
    path = hub.path("org/big", "big.pt")
    requests, sent = hub.log.requests(path), hub.log.sent(path)
    assert requests <= records + 8
    assert sent < src.stat().st_size // 3
    assert re.search(rf"remote: {requests} requests, .* \({sent:,} bytes\)", err), err
    ranges = [h.range for h in hub.log.for_path(path)]
    assert all(r is not None for r in ranges)  # no request for the whole file
    spans = [range(int(a), int(b) + 1) for a, b in (r[6:].split("-") for r in ranges)]
    assert sum(map(len, spans)) == len(set().union(*spans))  # no byte fetched twice


@pytest.mark.parametrize("case", ["404", "401", "timeout", "refused", "no-range"])
def test_failures_to_read_give_one_line_and_an_exit_code(
    hub, no_range, dead_ends, monkeypatch, tmp_path, case
) -> None:
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "1")
    big = tmp_path / "big.pt"  # larger than the first range asked for
    torch.save({"w": torch.zeros(1 << 18)}, big)
    url, code, words = {
        "404": ("hf://org/none/model.pt", 2, "not found"),
        "401": (hub.put("org/gated", "model.pt", big), 8, "HF_TOKEN"),
        "timeout": (f"{dead_ends.stalled}/model.pt", 8, "CKPT_REMOTE_TIMEOUT"),
        "refused": (f"{dead_ends.refused}/model.pt", 8, "could not connect"),
        "no-range": (no_range.put("model.pt", big), 8, "Range"),
    }[case]
    hub.gated["org/gated"] = "secret"
    _, out, err = run_ckpt("scan", url, code=code)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert words in err


@pytest.mark.parametrize("name", ["c8-3480d58089.pt", "c8-d2e6c4c788.pt"])
def test_a_zip_zipfile_shifts_before_its_start_gets_the_local_verdict(hub, name) -> None:
    """zipfile lists such an archive's records at negative offsets; the lenient walk skips
    them, and a read there is refused by a remote file as os.pread refuses it."""
    path = Path(__file__).parents[2] / "fuzz" / "regressions" / name
    url = hub.put("org/fuzz", name, path)
    remote = run_ckpt("scan", "--json", url, code=None)
    local = run_ckpt("scan", "--json", path, code=None)
    assert (remote.returncode, local.returncode) == (4, 4), remote.stderr
    assert _same_path(json.loads(remote.stdout), url, path) == json.loads(local.stdout)
