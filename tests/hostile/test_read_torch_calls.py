"""The torch calls a pickle may make are checked as torch checks them.

So are the storage ids torch's ``persistent_load`` unpacks: a device tag that is not text
(an int, non-ASCII bytes) fails in torch's ``default_restore_location``, and is refused here.

``torch.device`` and ``torch.Size`` are on the allowlist; their stand-ins never call torch,
so they must refuse every argument torch itself refuses (a device string or a size that is
a shell command, say). The real call is the oracle.
"""

from __future__ import annotations

import pickle
import subprocess
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_tools.errors import EXIT_CORRUPT, CorruptCheckpointError
from ckpt_tools.formats import open_checkpoint
from tests.helpers import console_script

DEVICE_ARGS = [
    *[(s,) for s in ("cpu", "cuda", "cuda:1", "meta", "mps", "xpu:3", "hpu", "privateuseone")],
    *[(s,) for s in ("cuda:01", "cuda:-1", "CUDA", "_", "cuda:", "cuda:1:2", " cpu", "cpu ")],
    *[(s,) for s in ("cuda:127", "cuda:128", "cuda:99999999999", "privateuse1", "touch x")],
    ("cpu", 0), ("cuda", 1), ("cuda:1", 1), ("cuda", -1), ("cuda", True), ("cuda", 1.0),
    ("cuda", 128), (-1,), (True,), (None,), (b"cpu",),
]  # fmt: skip
SIZE_ARGS = [
    ((1, 2),), ([1, 2],), ((),), ((True,),), ((-1,),), ((1.5,),), ("ab",), (3,), ((1 << 70,),),
    ((None,),), ({"a": 1},),
]  # fmt: skip

LAYOUTS = [
    ("torch.strided",), ("torch.sparse_coo",), ("torch.sparse_csr",), ("torch.jagged",),
    ("torch.nope",), ("sparse_coo",), ("torch.float32",), (3,),
]  # fmt: skip


def _calling(tmp_path: Path, qualname: str, args: tuple[Any, ...]) -> Path:
    """A pickle of ``{"v": qualname(*args)}``, written as torch.save's pickler would call it."""
    module, name = qualname.rsplit(".", 1)
    call = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    call += pickle.dumps(args, protocol=2)[2:-1] + b"R"  # the args tuple, then REDUCE
    path = tmp_path / "call.pkl"
    path.write_bytes(b"\x80\x02}X\x01\x00\x00\x00v" + call + b"s.")
    return path


def _torch_accepts(func: Any, args: tuple[Any, ...]) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about 'mkldnn'
            func(*args)
    except (RuntimeError, TypeError, ValueError, KeyError, AttributeError):
        return False
    return True


@pytest.mark.parametrize(
    ("qualname", "func", "args"),
    [("torch.device", torch.device, a) for a in DEVICE_ARGS]
    + [("torch.Size", torch.Size, a) for a in SIZE_ARGS]
    + [("torch.serialization._get_layout", torch.serialization._get_layout, a) for a in LAYOUTS],
    ids=[f"device{a!r}" for a in DEVICE_ARGS]
    + [f"Size{a!r}" for a in SIZE_ARGS]
    + [f"layout{a!r}" for a in LAYOUTS],
)
def test_we_refuse_every_call_torch_refuses(
    tmp_path: Path, qualname: str, func: Any, args: tuple[Any, ...]
) -> None:
    path = _calling(tmp_path, qualname, args)
    torch_reads = _torch_accepts(func, args)
    if torch_reads:  # the crafted pickle is the call it claims to be
        assert pickle.loads(path.read_bytes())["v"] == func(*args)
    try:
        open_checkpoint(path)
        ours = True
    except CorruptCheckpointError:
        ours = False
    # Refusing what torch reads is allowed (an int8-wrapping device index, say); the reverse
    # is what an attacker uses.
    assert ours <= torch_reads, f"torch refuses {qualname}{args!r}, we read it"


def test_what_torch_save_writes_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "devices.pt"
    torch.save({"d": torch.device("cuda", 1), "c": torch.device("cpu"), "s": torch.Size([2])}, path)
    root = open_checkpoint(path).root
    assert list(root["s"]) == [2] and "cuda" in repr(root["d"])


def test_a_refused_call_is_one_line_and_exit_4(tmp_path: Path) -> None:
    path = _calling(tmp_path, "torch.device", ('touch "$HOME/pwned"',))
    run = subprocess.run(
        [console_script(), "inspect", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == EXIT_CORRUPT
    assert run.stderr.count("\n") == 1 and "torch.device" in run.stderr


def _torch_loads(path: Path) -> bool:
    """torch.load's answer; where only the weights-only unpickler's opcode set is in the way
    (SHORT_BINBYTES), the full unpickler's, as our reader reads every opcode (README)."""
    errors = (RuntimeError, TypeError, UnicodeDecodeError, pickle.UnpicklingError)
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Unsupported operand" not in str(e):
            return False
        try:
            torch.load(path, weights_only=False)  # a file this test wrote, no globals of ours
        except errors:
            return False
    except errors:
        return False
    return True


@pytest.mark.parametrize("tag", [b"K\xd8", b"C\x03cp\xe9", b"N", b"C\x03cpu"])
def test_a_storage_device_tag_that_is_not_text_is_refused_like_torch(
    tmp_path: Path, tag: bytes
) -> None:
    clean = tmp_path / "clean.pt"
    torch.save({"w": torch.ones(2)}, clean)
    path = tmp_path / "tagged.pt"
    with zipfile.ZipFile(clean) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):  # the tag: BINUNICODE 'cpu' -> ``tag``
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", tag)
            dst.writestr(info, data)
    torch_reads = _torch_loads(path)
    if torch_reads:  # ASCII bytes (a Python 2 tag): torch decodes them, and so do we
        assert open_checkpoint(path).root["w"].device == "cpu"
    else:
        with pytest.raises(CorruptCheckpointError, match="unexpected storage id"):
            open_checkpoint(path)


def test_sparse_tensors_torch_saves_still_read_and_unknown_layouts_are_refused(tmp_path: Path):
    i, v = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])
    coo = torch.sparse_coo_tensor(i, v, (2, 2))
    path = tmp_path / "sparse.pt"
    torch.save({"coo": coo, "csr": coo.to_sparse_csr()}, path)
    assert set(open_checkpoint(path).root) == {"coo", "csr"}
    bad = tmp_path / "bad.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("/data.pkl"):
                assert data.count(b"torch.sparse_coo") == 1
                data = data.replace(b"torch.sparse_coo", b"torch.sparse_cox")
            dst.writestr(info, data)
    with pytest.raises(KeyError):  # torch's _get_layout looks the name up
        torch.load(bad, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match="sparse_cox"):
        open_checkpoint(bad)
