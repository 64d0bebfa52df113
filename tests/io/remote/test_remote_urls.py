"""URLs taken apart: which strings are URLs, hf:// resolved as huggingface_hub resolves it, the
Hub token and where it is sent, folder candidates, and names beside a file.

The resolution is checked against huggingface_hub's own ``hf_hub_url`` where it is installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_tools.errors import EXIT_USAGE, CorruptCheckpointError, UsageError
from ckpt_tools.io.remote.hub_token import hf_token
from ckpt_tools.io.remote.urls import (
    FOLDER_FILES,
    auth_headers,
    folder_candidates,
    is_folder_url,
    is_url,
    parse_hf,
    resolve,
    sibling,
    split_s3,
)
from tests.helpers.cli import run_ckpt
from tests.helpers.committed import fixture_path
from tests.helpers.servers import HubServer


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ("https://host/x.pt", True),
        ("HTTP://host/x.pt", True),
        ("hf://org/repo", True),
        ("Hf://org/repo/x.bin", True),
        ("s3://bucket/key", True),
        ("ftp://host/x.pt", False),
        ("model.pt", False),
        ("./hf:/org", False),
        ("C:\\models\\x.pt", False),
        (Path("hf://org/repo"), False),  # a Path is a local path, whatever it spells
        (b"https://host/x", False),
        (None, False),
    ],
)
def test_is_url(obj: object, expected: bool) -> None:
    assert is_url(obj) is expected


@pytest.mark.parametrize(
    ("url", "prefix", "repo", "revision", "path"),
    [
        ("hf://org/m", "", "org/m", "main", ""),
        ("hf://org/m/model.safetensors", "", "org/m", "main", "model.safetensors"),
        ("hf://org/m@v1.0/sub/a.bin", "", "org/m", "v1.0", "sub/a.bin"),
        ("hf://org/m@refs/pr/1/a.bin", "", "org/m", "refs/pr/1", "a.bin"),
        ("hf://org/m@refs%2Fpr%2F12/a.bin", "", "org/m", "refs/pr/12", "a.bin"),
        ("hf://org/m@refs/convert/parquet", "", "org/m", "refs/convert/parquet", ""),
        ("hf://org/m@abc123def", "", "org/m", "abc123def", ""),
        ("hf://models/org/m/x.pt", "", "org/m", "main", "x.pt"),
        ("hf://datasets/org/d@dev/x.pt", "datasets/", "org/d", "dev", "x.pt"),
        ("hf://spaces/org/s/app.pt", "spaces/", "org/s", "main", "app.pt"),
        ("hf://org/m/", "", "org/m", "main", ""),
    ],
)
def test_parse_hf(url: str, prefix: str, repo: str, revision: str, path: str) -> None:
    hub = parse_hf(url)
    assert (hub.prefix, hub.repo_id, hub.revision, hub.path) == (prefix, repo, revision, path)


@pytest.mark.parametrize(
    "url",
    [
        "hf://gpt2",
        "hf://org/",
        "hf://org/m@/x.bin",
        "hf://org/m/../x.bin",
        "hf://o rg/m/x",
        "x.pt",
        "hf://org/m@../x.bin",
        "hf://org/m@%2e%2e/x.bin",
        "hf://org/m/%2e%2e/x.bin",
        "hf://org/m@v1/sub/%2E/x.bin",
        "hf://org/m@.",
        "hf://org/m@v1%2F..%2Fmain/x.bin",
    ],
)
def test_parse_hf_refuses(url: str) -> None:
    with pytest.raises(UsageError):
        parse_hf(url)


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("hf://datasets/org", "datasets"),
        ("hf://datasets/org/", "datasets"),
        ("hf://datasets/org@v1", "datasets"),
        ("hf://datasets/org@v1/x.pt", "datasets"),
        ("hf://spaces/org", "spaces"),
        ("hf://models/org", "models"),
        ("HF://datasets", "datasets"),
    ],
)
def test_a_repo_type_without_a_repo_says_so(url: str, kind: str) -> None:
    """``hf://datasets/ORG`` is not the model repo ``datasets/ORG``: the message names the
    form that fixes it, as ``ckpt`` prints it (one line, exit 2), not a candidate file."""
    from tests.helpers.cli import run_ckpt

    with pytest.raises(UsageError) as info:
        parse_hf(url)
    message = str(info.value)
    assert message.startswith(f"{url!r}: hf://{kind}/ORG/REPO needs a repo"), message
    assert f"write hf://{kind}/ORG/REPO[@REV][/PATH]" in message and "\n" not in message
    with pytest.raises(UsageError, match="needs a repo"):
        is_folder_url(url)
    _, out, err = run_ckpt("inspect", url, code=2)
    assert out == "" and err.strip().endswith(message), err


@pytest.mark.parametrize(
    ("url", "kind", "repo", "revision", "filename"),
    [
        ("hf://org/m/model.safetensors", None, "org/m", None, "model.safetensors"),
        ("hf://org/m@refs/pr/1/sub/a b.bin", None, "org/m", "refs/pr/1", "sub/a b.bin"),
        ("hf://datasets/org/d@v2/x.pt", "dataset", "org/d", "v2", "x.pt"),
        ("hf://spaces/org/s/app.pt", "space", "org/s", None, "app.pt"),
    ],
)
def test_resolution_matches_huggingface_hub(
    url: str, kind: str | None, repo: str, revision: str | None, filename: str
) -> None:
    """The URL a request goes to is the one huggingface_hub's hf_hub_url builds."""
    file_download = pytest.importorskip("huggingface_hub.file_download")
    endpoint = "https://hub.example"
    expected = file_download.hf_hub_url(
        repo, filename, repo_type=kind, revision=revision, endpoint=endpoint
    )
    assert parse_hf(url).resolve(endpoint) == expected


def test_resolve_uses_hf_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert resolve("hf://org/m/x.pt") == "https://huggingface.co/org/m/resolve/main/x.pt"
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9/")
    assert resolve("hf://org/m/x.pt") == "http://127.0.0.1:9/org/m/resolve/main/x.pt"
    assert resolve("https://a.example/x.pt") == "https://a.example/x.pt"


def test_split_s3() -> None:
    assert split_s3("s3://bucket/a/b.pt") == ("bucket", "a/b.pt")
    assert split_s3("s3://bucket") == ("bucket", "")
    with pytest.raises(UsageError, match="no bucket"):
        split_s3("s3:///key")
    assert split_s3("s3://my.bucket_1-a/k") == ("my.bucket_1-a", "k")


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("s3://my bucket/model.pt", "'my bucket' is not a bucket name"),
        ("s3://minio:9000/model.pt", "the endpoint goes in AWS_ENDPOINT_URL"),
    ],
)
def test_a_bucket_botocore_would_refuse_is_a_usage_error(url: str, said: str) -> None:
    # Said before any request: the URL is what to fix, not the endpoint.
    with pytest.raises(UsageError, match=said) as info:
        split_s3(url)
    assert "write s3://BUCKET/KEY" in str(info.value)
    code, out, err = run_ckpt("inspect", url, code=None)
    assert code == EXIT_USAGE and not out and said in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("url", "folder"),
    [
        ("hf://org/m", True),
        ("hf://org/m@refs/pr/3", True),
        ("hf://org/m/sub/", True),
        ("hf://org/m/x.bin", False),
        ("https://host/runs/", True),
        ("https://host", True),
        ("https://host/runs/x.pt?download=1", False),
        ("s3://bucket/run/", True),
        ("s3://bucket", True),
        ("s3://bucket/run/last.ckpt", False),
    ],
)
def test_is_folder_url(url: str, folder: bool) -> None:
    assert is_folder_url(url) is folder


def test_folder_candidates_in_transformers_order() -> None:
    # transformers' _get_resolved_checkpoint_files: the single file first, then its index.
    assert FOLDER_FILES == (
        "model.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
    )
    for folder, base in [
        ("hf://org/m", "hf://org/m/"),
        ("hf://org/m@refs/pr/1", "hf://org/m@refs/pr/1/"),
        ("hf://datasets/org/d/sub/", "hf://datasets/org/d/sub/"),
        ("https://host/runs", "https://host/runs/"),
        ("s3://bucket/run/", "s3://bucket/run/"),
        ("s3://bucket", "s3://bucket/"),
        # An S3 key is a plain string: "exp1//" (a prefix joined to "/") is its own folder.
        ("s3://bucket/exp1//", "s3://bucket/exp1//"),
    ]:
        assert folder_candidates(folder) == [base + name for name in FOLDER_FILES]
    # A folder URL's query is sent with each file tried in it.
    queried = folder_candidates("https://host/runs/?token=T&x=1")
    assert queried == [f"https://host/runs/{name}?token=T&x=1" for name in FOLDER_FILES]
    # A revision with slashes still parses after a name is joined on.
    assert parse_hf(folder_candidates("hf://org/m@refs/pr/1")[1]).revision == "refs/pr/1"


@pytest.mark.parametrize(
    ("url", "name", "expected"),
    [
        ("hf://org/m/model.safetensors.index.json", "a.safetensors", "hf://org/m/a.safetensors"),
        ("hf://org/m@refs/pr/1/sub/i.json", "a.bin", "hf://org/m@refs/pr/1/sub/a.bin"),
        ("hf://org/m@v1/i.json", "shards/a.bin", "hf://org/m@v1/shards/a.bin"),
        ("https://h/x/i.json?sig=1", "a b.bin", "https://h/x/a%20b.bin?sig=1"),
        ("https://h/x/i.json?t=1#frag", "a.bin", "https://h/x/a.bin?t=1"),
        ("https://h/i.json", "a%2e%2e.bin", "https://h/a%252e%252e.bin"),
        ("s3://b/run/i.json", "a.bin", "s3://b/run/a.bin"),
        ("s3://b/i.json", "a.bin", "s3://b/a.bin"),
        ("s3://b/exp1//i.json", "a.bin", "s3://b/exp1//a.bin"),
        ("s3://b//i.json", "a.bin", "s3://b//a.bin"),
    ],
)
def test_sibling(url: str, name: str, expected: str) -> None:
    assert sibling(url, name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "../x.bin",
        "sub/../../x.bin",
        "/abs.bin",
        "",
        "./x.bin",
        "a//b.bin",
        "..\\x.bin",
        "https://e/x",
    ],
)
def test_sibling_refuses_names_that_leave_the_folder(name: str) -> None:
    for url in ("hf://org/m/i.json", "https://h/d/i.json", "s3://b/d/i.json"):
        with pytest.raises(CorruptCheckpointError, match="not a file beside it"):
            sibling(url, name)


def test_a_folder_or_index_url_s_query_is_sent_for_every_file_it_leads_to(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that takes a token in the URL answers the shards, and the folder's files,
    only with it: each request carries the query of the URL given."""
    import torch

    import ckpt_tools as ct
    from ckpt_tools.errors import RemoteAccessError

    torch.save(
        {f"layer{i}.weight": torch.full((64,), float(i)) for i in range(3)}, tmp_path / "m.pt"
    )
    ct.convert(tmp_path / "m.pt", f"{tmp_path}/hf/", max_shard_size="300B")
    for file in sorted((tmp_path / "hf").iterdir()):
        hub.put_file(f"hf/{file.name}", file)
    hub.query = "token=T0K"
    monkeypatch.delenv("HF_ENDPOINT")  # a server of its own, not the Hub
    local = [(t.name, t.shape) for t in ct.inspect(tmp_path / "hf").tensors]
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 3
    for url in (
        f"{hub.url}/files/hf/model.safetensors.index.json?token=T0K",
        f"{hub.url}/files/hf/?token=T0K",
    ):
        assert [(t.name, t.shape) for t in ct.inspect(url).tensors] == local, url
    with pytest.raises(RemoteAccessError, match="wants credentials"):
        ct.inspect(f"{hub.url}/files/hf/model.safetensors.index.json")


# --- the Hub token ------------------------------------------------------------------------


def test_token_order(remote_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """HF_TOKEN, else the file at HF_TOKEN_PATH, else HF_HOME/token; none -> None."""
    assert hf_token() is None
    (remote_env / "token").write_text("hf_home_file\n")
    assert hf_token() == "hf_home_file"
    other = tmp_path / "elsewhere"
    other.write_text("  hf_token_path  ")
    monkeypatch.setenv("HF_TOKEN_PATH", str(other))
    assert hf_token() == "hf_token_path"
    monkeypatch.setenv("HF_TOKEN", "hf_env\n")
    assert hf_token() == "hf_env"


def test_token_home_defaults_to_the_cache_folder(
    remote_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "huggingface").mkdir(parents=True)
    (tmp_path / "cache" / "huggingface" / "token").write_text("hf_xdg")
    assert hf_token() == "hf_xdg"


def test_a_token_no_header_can_carry_is_refused_without_showing_it(
    remote_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_se cret")
    with pytest.raises(UsageError, match="HF_TOKEN") as info:
        hf_token()
    assert "cret" not in str(info.value)


def test_the_token_goes_to_the_endpoint_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    bearer = {"Authorization": "Bearer t"}
    assert auth_headers("hf://org/m/x.pt", "t") == bearer
    assert auth_headers("https://HUB.example/org/m/resolve/main/x.pt", "t") == bearer
    assert auth_headers("https://cdn.example/x.pt", "t") == {}
    assert auth_headers("http://hub.example/x.pt", "t") == {}  # another scheme, another origin
    assert auth_headers("hf://org/m/x.pt", None) == {}


def test_an_hf_endpoint_without_a_scheme_leaves_other_urls_alone(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HF_ENDPOINT=hub.internal:8080`` is no URL: a plain URL is read as if it were unset
    (no URL is at that endpoint, so no token goes anywhere), and an ``hf://`` URL is refused
    naming the variable and what to write, before any request."""
    url = hub.put_file("model.pt", fixture_path("model.pt"))
    monkeypatch.setenv("HF_ENDPOINT", "hub.internal:8080")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert auth_headers(url, "hf_secret") == {}
    run_ckpt("inspect", url)
    assert {h.authorization for h in hub.log.for_path()} == {None}
    hub.log.clear()
    _, out, err = run_ckpt("inspect", "hf://org/repo/model.pt", code=EXIT_USAGE)
    assert "HF_ENDPOINT='hub.internal:8080' is not an http(s) URL" in err, err
    assert "write HF_ENDPOINT=https://hub.internal:8080" in err and out == ""
    assert hub.log.requests() == 0


@pytest.mark.parametrize("host", ["example..com", "xn--", "a" * 64 + ".com"])
def test_a_host_no_request_can_encode_is_a_malformed_url(
    remote_env: Path, monkeypatch: pytest.MonkeyPatch, host: str
) -> None:
    """An empty label, one over 63 characters, an ``xn--`` label that is no Punycode: the
    URL given, or ``HF_ENDPOINT``, is refused in one line with exit 2, its password unshown."""
    url = f"https://alice:s3cr3t@{host}/model.pt"
    for command in ("inspect", "scan"):
        _, out, err = run_ckpt(command, url, code=EXIT_USAGE)
        assert out == "" and len(err.strip().splitlines()) == 1, err
        assert f"'https://***@{host}/model.pt' has a malformed host {host!r}" in err, err
        assert "s3cr3t" not in err and "write http(s)://HOST/PATH" in err
    monkeypatch.setenv("HF_ENDPOINT", f"https://{host}")
    _, out, err = run_ckpt("inspect", "hf://org/repo/model.pt", code=EXIT_USAGE)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert f"HF_ENDPOINT='https://{host}' has a malformed host" in err, err
    assert "write HF_ENDPOINT=https://HOST" in err
