"""``--no-fsync`` (``durable=False``): outputs are as whole, verified and atomic as ever; only
the fsyncs, and the early writeback that exists to shorten them, are skipped.

Oracles: ``torch.load`` for what was written, and ``strace`` for which sync calls a real
``ckpt`` process makes (those tests skip where strace is missing or not allowed).
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import click
import pytest
import torch

from ckpt_tools.cli.main import cli
from ckpt_tools.io.atomic import atomic_output
from ckpt_tools.io.copy.clone import _WRITEBACK_EVERY
from ckpt_tools.ops.rewrite.rewriting import strip_module
from tests.helpers.builders import load, save
from tests.helpers.cli import ckpt_env, console_script
from tests.helpers.committed import FIXTURES
from tests.helpers.lora import write_tiny_adapter

SYNCS = ("fsync", "fdatasync", "sync_file_range", "syncfs", "sync", "msync")


def test_writers_are_told_whether_their_output_will_be_synced(tmp_path: Path) -> None:
    with atomic_output(tmp_path / "a.bin", durable=False) as outer:
        assert not outer.durable
        with atomic_output(tmp_path / "b.bin") as inner:
            assert inner.durable
            inner.file.write(b"inner")
        assert not outer.durable  # each output's own, however they nest
        outer.file.write(b"outer")
    assert (tmp_path / "a.bin").read_bytes() == b"outer"
    assert (tmp_path / "b.bin").read_bytes() == b"inner"
    # Replacing a file is always durable, and the writers are told so.
    with atomic_output(tmp_path / "a.bin", replace=True, durable=False) as again:
        assert again.durable
        again.file.write(b"again")
    assert (tmp_path / "a.bin").read_bytes() == b"again"


def test_a_failed_non_durable_output_leaves_nothing(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="boom"),
        atomic_output(tmp_path / "a.bin", durable=False) as out,
    ):
        out.file.write(b"partial")
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_a_non_durable_rewrite_writes_what_a_durable_one_writes(tmp_path: Path) -> None:
    sd = {"module.w": torch.arange(6.0).reshape(2, 3), "module.b": torch.ones(3)}
    src = save(sd, tmp_path / "in.pt")
    synced = strip_module(src, tmp_path / "synced.pt")
    fast = strip_module(src, tmp_path / "fast.pt", durable=False)
    assert fast.verification == synced.verification
    assert fast.bytes_copied == synced.bytes_copied
    a, b = load(tmp_path / "synced.pt"), load(tmp_path / "fast.pt")
    assert list(a) == list(b) == ["w", "b"]
    assert all(torch.equal(a[k], b[k]) and torch.equal(b[k], sd[f"module.{k}"]) for k in a)


def _command(name: str) -> click.Command:
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, name
    return command


def _writing_commands() -> list[str]:
    """Every command that writes a file (each has --verify)."""
    return sorted(
        name
        for name in cli.list_commands(click.Context(cli))
        if any("--verify" in p.opts for p in _command(name).params)
    )


def test_every_writing_command_offers_no_fsync() -> None:
    writing = _writing_commands()
    assert {"strip-module", "convert", "slim", "average", "consolidate"} <= set(writing)
    for name in writing:
        params = {p.name: p for p in _command(name).params}
        durable = params.get("durable")
        assert durable is not None, f"ckpt {name} has --verify but no --fsync/--no-fsync"
        assert "--no-fsync" in durable.secondary_opts and durable.default is True, name


def _strace() -> str:
    found = shutil.which("strace")
    if found is None:
        pytest.skip("strace is not installed")
    probe = subprocess.run([found, "-f", "-qq", "-o", "/dev/null", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace here: {probe.stderr.decode().strip()[:200]}")
    return found


def _sync_calls(tmp_path: Path, *args: object) -> Counter[str]:
    """Run the real ``ckpt ARGS`` under strace; how often it called each sync function."""
    log = tmp_path / f"strace-{len(list(tmp_path.glob('strace-*')))}.log"
    cmd = [_strace(), "-f", "-qq", "-e", f"trace={','.join(SYNCS)}", "-o", str(log)]
    cmd += [console_script(), *map(str, args)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=ckpt_env(), timeout=300)
    assert run.returncode == 0, run.stderr
    calls = Counter[str]()
    for line in log.read_text().splitlines():
        name = line.split(None, 1)[1].split("(", 1)[0] if " " in line else ""
        if name in SYNCS:
            calls[name] += 1
    return calls


@pytest.fixture
def inputs(tmp_path: Path) -> Callable[[str], list[object]]:
    """``inputs(command)``: the arguments that make ``command`` write something real."""
    sd = {"module.w": torch.randn(4, 4), "module.b": torch.randn(4)}
    pt = save(sd, tmp_path / "in.pt")
    other = save({k: v + 1 for k, v in sd.items()}, tmp_path / "in2.pt")

    def make(command: str) -> list[object]:
        out = tmp_path / f"out-{command}"
        if command == "reshard":
            folder = tmp_path / "hf"
            subprocess.run(
                [console_script(), "convert", pt, f"{folder}/", "--max-shard-size", "100"],
                check=True,
                capture_output=True,
                env=ckpt_env(),
            )
            return [command, folder, out, "--max-shard-size", "200", "--jobs", "2"]
        if command == "consolidate":
            import torch.distributed.checkpoint as dcp

            with warnings.catch_warnings():  # (saving without a process group warns)
                warnings.simplefilter("ignore")
                dcp.save({"model": dict(sd)}, checkpoint_id=str(tmp_path / "dcp"))
            return [command, tmp_path / "dcp", out.with_suffix(".pt")]
        if command == "average":
            return [command, pt, other, out.with_suffix(".pt")]
        if command == "merge-lora":
            base = shutil.copyfile(FIXTURES / "plain.pt", tmp_path / "tiny.pt")
            return [command, base, write_tiny_adapter(tmp_path / "lora"), out.with_suffix(".pt")]
        extra = {
            "convert": [f"{out}/", "--max-shard-size", "100"],
            "extract": [out.with_suffix(".pt"), "--prefix", "module."],
            "retag": [out.with_suffix(".pt"), "--map", "cpu=cuda:0"],
            "rename": [out.with_suffix(".pt"), "--sub", "module.=net."],
            "slim": [out.with_suffix(".safetensors"), "--dtype", "bf16"],
        }
        return [command, pt, *extra.get(command, [out.with_suffix(".pt")])]

    return make


@pytest.mark.parametrize("command", _writing_commands())
def test_no_fsync_makes_no_sync_call_and_the_default_syncs(
    tmp_path: Path, inputs: Callable[[str], list[object]], command: str
) -> None:
    args = inputs(command)
    synced = _sync_calls(tmp_path, *args)
    assert synced["fsync"] >= 1, f"ckpt {command} wrote without an fsync: {dict(synced)}"
    out = Path(str(args[3] if command in ("average", "merge-lora") else args[2]))
    shutil.rmtree(out) if out.is_dir() else out.unlink()
    unsynced = _sync_calls(tmp_path, *args, "--no-fsync")
    assert sum(unsynced.values()) == 0, f"ckpt {command} --no-fsync synced: {dict(unsynced)}"
    assert out.exists()


def test_no_fsync_starts_no_early_writeback(tmp_path: Path) -> None:
    # Large enough that a durable rewrite starts its writeback at least once.
    n = _WRITEBACK_EVERY // 4 + (1 << 16)
    src = save({"module.w": torch.ones(n)}, tmp_path / "big.pt")
    durable = _sync_calls(tmp_path, "strip-module", src, tmp_path / "a.pt", "--quiet")
    assert durable["sync_file_range"] >= 1 and durable["fsync"] >= 1, dict(durable)
    fast = _sync_calls(tmp_path, "strip-module", src, tmp_path / "b.pt", "-q", "--no-fsync")
    assert sum(fast.values()) == 0, dict(fast)
    assert torch.equal(load(tmp_path / "b.pt")["w"], torch.ones(n))


@pytest.mark.parametrize("how", ["--force", "--in-place"])
def test_no_fsync_still_syncs_an_output_that_replaces_a_file(tmp_path: Path, how: str) -> None:
    # Renamed over an existing file before its bytes are on disk, a power loss could lose
    # the old file and the new one: replacing is always durable.
    src = save({"module.w": torch.ones(3)}, tmp_path / "in.pt")
    dst = src if how == "--in-place" else tmp_path / "out.pt"
    if how == "--force":
        dst.write_bytes(b"an older output")
    calls = _sync_calls(tmp_path, "strip-module", src, dst, how, "--no-fsync", "-q")
    assert calls["fsync"] >= 1, dict(calls)
    assert torch.equal(load(dst)["w"], torch.ones(3))
    fresh = _sync_calls(tmp_path, "strip-module", src, tmp_path / "new.pt", "--no-fsync", "-q")
    assert sum(fresh.values()) == 0, dict(fresh)


def test_no_fsync_still_syncs_a_shard_folder_that_replaces_one(tmp_path: Path) -> None:
    src = save({f"w{i}": torch.full((64,), float(i)) for i in range(4)}, tmp_path / "in.pt")
    out = tmp_path / "hf"
    args = ["convert", src, f"{out}/", "--max-shard-size", "600", "--no-fsync"]
    assert sum(_sync_calls(tmp_path, *args).values()) == 0
    assert _sync_calls(tmp_path, *args, "--force")["fsync"] >= 3  # shards, index, folders
