"""What a URL shows of itself: every credential it carries (its userinfo, a token given as the
user name, a query's values) is sent and never shown, by the commands that read URLs and by
those that refuse them; each against the suite's servers (tests/helpers/servers.py).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

import ckpt_tools as ct
from ckpt_tools.errors import EXIT_REMOTE, EXIT_USAGE, RemoteAccessError, UsageError
from ckpt_tools.io.remote import RemoteSession
from ckpt_tools.io.remote.httpurls import credentials, shown_url, split_http
from tests.helpers.cli import run_ckpt
from tests.helpers.servers import HubServer

REFUSAL = "is a URL; inspect, scan, diff, extract and slim read URLs"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2, 3), "b": torch.zeros(3)}, path)
    return path


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://me:secret@host.example/m.pt", "https://***@host.example/m.pt"),
        ("https://ghp_TOKEN@host.example/m.pt", "https://***@host.example/m.pt"),
        ("HTTP://me:s@h:8080/a/b.pt?x=1#frag", "HTTP://***@h:8080/a/b.pt?x=***#***"),
        ("https://h/m.pt?X-Amz-Signature=QS&X-Amz-Date=1", "https://h/m.pt?X-Amz-Signature=***&X-Amz-Date=***"),
        ("https://h/m.pt?QSECRET", "https://h/m.pt?***"),
        ("http://me:p4ss/S3CRET@h:1/m.pt", "http://***@h:1/m.pt"),
        ("http://me:p4ss?S3CRET@h:1/m.pt", "http://***@h:1/m.pt"),
        ("http://me:p4ss#S3CRET@h:1/m.pt", "http://***@h:1/m.pt"),
        ("https://h/models/a@b/m.pt", "https://h/models/a@b/m.pt"),  # an '@' in a path
        ("https://***@h/m.pt?t=***", "https://***@h/m.pt?t=***"),  # shown twice, the same
        ("hf://org/repo@v1/model.pt", "hf://org/repo@v1/model.pt"),
        ("s3://bucket/key", "s3://bucket/key"),
        ("model.pt", "model.pt"),
    ],
)  # fmt: skip
def test_a_url_is_shown_without_its_credentials(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_any_userinfo_is_a_credential_but_the_mark_that_hides_one() -> None:
    assert credentials("http://ghp_TOKEN@Host:1/m.pt") == ("http://host:1", "ghp_TOKEN")
    assert credentials("http://***@host/m.pt") == ("http://host", None)


@pytest.mark.parametrize("password", ["p4ss/S3CRET", "p4ss?S3CRET", "p4ss#S3CRET"])
def test_a_password_that_ends_the_host_early_is_refused_unquoted(
    hub: HubServer, password: str
) -> None:
    """A password holding an unescaped '/', '?' or '#': urlsplit ends the host there and
    would quote the rest as a port; the refusal says what to percent-encode, nothing of it."""
    url = hub.put_file("model.pt", b"x").replace("://", f"://me:{password}@")
    with pytest.raises(UsageError) as info:
        split_http(url)
    assert "p4ss" not in str(info.value) and "S3CRET" not in str(info.value)
    assert "percent-encoded (%2F, %3F, %23)" in str(info.value)
    _, out, err = run_ckpt("inspect", url, code=EXIT_USAGE)
    assert "p4ss" not in out + err and "S3CRET" not in out + err and "***@127.0.0.1" in err
    assert hub.log.requests() == 0


def test_a_token_as_the_user_name_is_sent_never_shown(hub: HubServer, model: Path) -> None:
    """``https://TOKEN@host/...``: sent as Basic auth (the token, an empty password), to the
    shards beside the file too; absent from --json and from a refusal's message."""
    url = hub.put_file("model.pt", model).replace("://", "://ghp_SECRETTOKEN@")
    _, out, err = run_ckpt("inspect", "--json", url)
    assert "SECRETTOKEN" not in out + err
    assert json.loads(out)["path"] == url.replace("ghp_SECRETTOKEN@", "***@")
    basic = "Basic " + base64.b64encode(b"ghp_SECRETTOKEN:").decode()
    assert {h.authorization for h in hub.log.for_path()} == {basic}
    hub.statuses["/files/refused.pt"] = 401
    refused = url.replace("model.pt", "refused.pt")
    _, out, err = run_ckpt("inspect", refused, code=EXIT_REMOTE)
    assert "SECRETTOKEN" not in out + err and "refused the credentials in the URL" in err


def test_each_folders_userinfo_goes_to_its_own_files_only(
    hub: HubServer, model: Path, tmp_path: Path
) -> None:
    """Two URLs of one host with two users: each folder's files (its shards, its search's
    misses) are asked for with that folder's credentials, never the other user's."""
    from huggingface_hub import save_torch_state_dict

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_torch_state_dict({f"w{i}": torch.ones(64) for i in range(4)}, sharded, max_shard_size=600)
    for file in sorted(sharded.iterdir()):
        url = hub.put_file(f"alice/{file.name}", file)
    alice = url.rpartition("/")[0].replace("://", "://alice:pw-a@") + "/"
    bob = hub.put_file("bob/model.pt", model).replace("://", "://bob:pw-b@")
    run_ckpt("scan", alice, bob, code=0)
    run_ckpt("scan", bob, alice, code=0)
    users = ("alice:pw-a", "bob:pw-b")
    basic = {who: "Basic " + base64.b64encode(who.encode()).decode() for who in users}
    hits = hub.log.for_path()
    assert {h.path.split("/")[-2] for h in hits} == {"alice", "bob"}
    for hit in hits:
        owner = "alice:pw-a" if "/alice/" in hit.path else "bob:pw-b"
        assert hit.authorization == basic[owner], hit
    with RemoteSession() as remote, pytest.raises(UsageError, match="two user names"):
        remote.named(alice)
        remote.named(alice.replace("pw-a", "pw-c") + "model.safetensors")


@pytest.mark.parametrize("up", ["..", "%2e%2E", "./.."])
def test_a_dot_segment_does_not_carry_a_folders_userinfo_to_another(
    hub: HubServer, model: Path, up: str
) -> None:
    # The request goes to /bob/ (dot segments are removed before it is sent): alice's
    # password is for /alice/ and below, whatever the path looked like when typed.
    alice = hub.put_file("alice/model.pt", model).replace("://", "://alice:pw-a@")
    bob = hub.put_file("bob/model.pt", model)
    other = bob.replace("/bob/", f"/alice/{up}/bob/")
    run_ckpt("diff", alice, other, "--no-values", code=None)
    hits = [h for h in hub.log.for_path() if "/bob/" in h.path]
    assert hits and all(h.authorization is None for h in hits), hits


@pytest.mark.parametrize("host", ["[::1", "[zz]", "host]"])
def test_a_malformed_host_after_a_password_is_refused_as_a_usage_error(host: str) -> None:
    _, out, err = run_ckpt("inspect", f"http://user:SECRETPW@{host}/m.pt", code=2)
    assert "SECRETPW" not in out + err and err.count("\n") == 1, err


def test_a_query_is_sent_and_shown_without_its_values(hub: HubServer, model: Path) -> None:
    """A presigned URL's signature, a ``token=``: the request carries them, the file's name
    (--json, messages) shows each value as ***."""
    url = hub.put_file("model.pt", model)
    signed = f"{url}?X-Amz-Signature=QSECRET&token=QTOKEN"
    _, out, err = run_ckpt("inspect", "--json", signed)
    assert "QSECRET" not in out + err and "QTOKEN" not in out + err
    assert json.loads(out)["path"] == f"{url}?X-Amz-Signature=***&token=***"
    with RemoteSession() as remote:
        f = remote.open(signed)
        assert f.url == f"{url}?X-Amz-Signature=***&token=***"
        assert f.transport.resolved == signed  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("?token=QSECRET", "the server refused the URL's query"),
        ("", "the server wants credentials ckpt_tools does not send"),
    ],
)
def test_a_refused_query_is_told_apart_from_no_credentials(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch, query: str, words: str
) -> None:
    monkeypatch.delenv("HF_ENDPOINT")  # a server of its own, not the Hub
    hub.statuses["/files/model.pt"] = 403
    url = f"{hub.url}/files/model.pt{query}"
    with RemoteSession() as remote, pytest.raises(RemoteAccessError) as info:
        remote.open(url)
    assert words in str(info.value) and "QSECRET" not in str(info.value)
    assert info.value.path == shown_url(url)


@pytest.mark.parametrize(
    ("name", "spelled"),
    [("my model.pt", "my model.pt"), ("model.pt", "x/../model.pt"), ("mödel.pt", "mödel.pt")],
)
@pytest.mark.parametrize("status", [401, 404])
def test_an_answer_of_the_url_itself_is_not_taken_for_a_redirects(
    hub: HubServer, model: Path, monkeypatch: pytest.MonkeyPatch, name: str, spelled: str,
    status: int,
) -> None:  # fmt: skip
    # httpx requests the URL normalised (%-escapes, dot segments, a lower-case host): that
    # is no redirect, and the remedy is the one for the URL's own credentials.
    monkeypatch.delenv("HF_ENDPOINT")  # a server of its own, not the Hub
    hub.statuses[hub.put_file(name, model).removeprefix(hub.url)] = status
    host = hub.url.replace("127.0.0.1", "LocalHost").replace("://", "://me:pw@")
    with RemoteSession() as remote, pytest.raises((RemoteAccessError, FileNotFoundError)) as info:
        remote.open(f"{host}/files/{spelled}")
    message = str(info.value)
    assert f"HTTP {status} " in message and " from " not in message, message
    assert "redirected" not in message and ("check them" in message or status == 404)


def test_two_urls_shown_the_same_are_not_read_as_one(hub: HubServer, model: Path) -> None:
    """Two URLs that differ only in what is hidden would share a name, and one's reads would
    be taken for the other's: refused, and nothing is read."""
    url = hub.put_file("model.pt", model)
    _, out, err = run_ckpt("scan", f"{url}?v=1", f"{url}?v=2", code=EXIT_USAGE)
    assert f"{url}?v=*** is given twice" in err and out == ""
    assert hub.log.requests() == 0


@pytest.mark.parametrize("folder_first", [False, True])
def test_a_folder_given_beside_a_file_with_other_query_values_is_refused(
    hub: HubServer, model: Path, folder_first: bool
) -> None:
    """The files a folder URL reads are named as shown (``…/pytorch_model.bin?v=***``): beside
    a file given there with other values, they would be asked for with the file's (the folder
    scanned at the file's version, and called clean): refused, and nothing is read."""
    url = hub.put_file("m/pytorch_model.bin", model)
    given = [f"{url}?v=1", f"{url.rpartition('/')[0]}/?v=2"]
    _, out, err = run_ckpt("scan", *(given[::-1] if folder_first else given), code=EXIT_USAGE)
    assert "is given with two queries" in err and "v=1" not in err and out == ""
    assert hub.log.requests() == 0


def test_files_of_one_folder_each_signed_are_each_read_with_their_own_query(
    hub: HubServer, model: Path
) -> None:
    # Presigned URLs: one signature per object, in one folder.
    a, b = hub.put_file("m/a.pt", model), hub.put_file("m/b.pt", model)
    with RemoteSession() as remote:
        assert remote.open(f"{a}?sig=A").transport.resolved == f"{a}?sig=A"  # type: ignore[attr-defined]
        assert remote.open(f"{b}?sig=B").transport.resolved == f"{b}?sig=B"  # type: ignore[attr-defined]


LOCAL_ONLY = [
    ("convert", "{url}", "{out}/b.safetensors"),
    ("average", "{url}", "{url}", "{out}/f.pt"),
    ("reshard", "{folder}", "{out}/g", "--max-shard-size", "1GB"),
    ("consolidate", "{folder}", "{out}/h.pt"),
    ("merge-lora", "{url}", "{folder}", "{out}/i"),
    ("merge-lora", "{model}", "{folder}", "{out}/i"),
    ("sanitize", "{url}", "{out}/j.pt"),
    ("strip-module", "{url}", "{out}/k.pt"),
]


@pytest.mark.parametrize("command", LOCAL_ONLY, ids=lambda c: " ".join(c[:2]))
def test_a_command_that_reads_local_files_refuses_a_url_by_name(
    hub: HubServer, model: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """The documented refusal (exit 2, naming the commands that read URLs) from every local
    reader, never "no such file" or another command's advice; the password never shown."""
    url = hub.put_file("model.pt", model).replace("://", "://me:PASSW0RD@")
    names = {"url": url, "folder": url.rpartition("/")[0] + "/", "model": model, "out": tmp_path}
    _, out, err = run_ckpt(*(part.format(**names) for part in command), code=EXIT_USAGE)
    assert REFUSAL in err and "download the file and pass its path" in err, err
    assert "PASSW0RD" not in out + err and "***@127.0.0.1" in err
    assert "no such file" not in err and "ckpt convert" not in err
    assert hub.log.requests() == 0


@pytest.mark.parametrize(
    "command",
    [
        ("extract", "{model}", "https://me:PASSW0RD@host.example/out.pt", "--prefix", "w"),
        ("convert", "{model}", "s3://bucket/out.safetensors"),
        ("slim", "{model}", "hf://org/repo/out.pt"),
        ("convert", "{model}", "https://me:PASSW0RD@host.example/out/"),
        ("strip-module", "{model}", "http://me:PASSW0RD@host.example/out.pt"),
    ],
    ids=lambda c: " ".join(c[:3:2]),
)
def test_a_url_given_as_the_output_is_refused_without_its_password(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    """Outputs are local paths: a URL is refused by name, never written as the local path
    'https:/me:PASSW0RD@host.example/...' it reads as, nor shown with its password."""
    monkeypatch.chdir(tmp_path)
    argv = [part.format(model=model) for part in command]
    _, out, err = run_ckpt(*argv, code=EXIT_USAGE)
    assert "is a URL; outputs are written to local paths only" in err, err
    assert "PASSW0RD" not in out + err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
    with pytest.raises(UsageError, match="outputs are written to local paths only"):
        ct.convert(model, "https://me:PASSW0RD@host.example/out.safetensors")


@pytest.mark.parametrize(
    "read",
    [
        ct.open_checkpoint,
        ct.detect_format,
        ct.load_state_dict,
        lambda url: ct.average([url, url], "avg.pt"),
        lambda url: ct.reshard(url, "out"),
        lambda url: ct.merge_lora("model.pt", url, "merged.pt"),
        lambda url: ct.consolidate(url.replace("model.pt", "__0_0.distcp"), "out.pt"),
    ],
    ids=[
        "open_checkpoint",
        "detect_format",
        "load_state_dict",
        "average",
        "reshard",
        "merge",
        "consolidate a shard",
    ],
)
def test_the_library_refuses_a_url_without_its_password(read: object) -> None:
    url = "http://me:PASSW0RD@127.0.0.1:9/ok/model.pt"
    with pytest.raises(UsageError) as info:
        read(url)  # type: ignore[operator]
    assert REFUSAL in str(info.value) and "PASSW0RD" not in str(info.value)
    assert info.value.path.startswith("http://***@127.0.0.1:9/ok/")
