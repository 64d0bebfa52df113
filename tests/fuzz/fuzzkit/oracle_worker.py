"""The reference readers, in a sandboxed process: what torch / safetensors / pickle make of a file.

Run as a script by :class:`fuzzkit.workers.Worker`: one JSON request per stdin line
(``{"path": ...}``), one JSON answer per line on the
original stdout (fd 1 is pointed at stderr so nothing else can corrupt the protocol).

For each file it reports:

- ``torch``: ``torch.load(weights_only=True)``; where torch's weights-only unpickler refuses
  only for a reason that is not about safety (the legacy tar format, a pickle opcode such as
  FRAME it does not implement), it retries ``torch.load`` with the same reading code and a
  ``pickle.Unpickler`` whose ``find_class`` admits exactly torch's weights-only allowlist
  (``"via": "restricted"``). Nothing outside that allowlist is ever imported or called.
- ``safetensors``: ``safetensors.safe_open``.
- ``pickle``: the whole file through that restricted unpickler (plain pickles).

Each answer is ``{"ok": true, "tree": ...}`` or ``{"ok": false, "error": ..., "unsafe": [...]}``.
"""

from __future__ import annotations

import _compat_pickle
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import sys
import types
import warnings
from typing import Any

warnings.simplefilter("ignore")
MAX_HASH_BYTES = 32 << 20
MAX_NODES = 20000
MAX_DEPTH = 64
# The name as torch's weights-only unpickler words it (any characters but a newline: a GLOBAL
# opcode's module and name are whole lines), in its two refusals and in ours below.
GLOBAL_RE = re.compile(r"GLOBAL ([^\n]+?) (?:whose module|was not an allowed global)")


def _allowed() -> dict[str, Any]:
    import torch._weights_only_unpickler as wo

    allowed = dict(wo._get_allowed_globals())
    allowed.update(wo._get_user_allowed_globals())
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """``find_class`` limited to torch's weights-only allowlist; everything else refused."""

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names, as pickle's fix_imports maps them (``__builtin__.set``).
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        key = f"{module}.{name}"
        allowed = _ALLOWED.get(key)
        if allowed is None:
            raise pickle.UnpicklingError(
                f"Unsupported global: GLOBAL {key} was not an allowed global by default"
            )
        return allowed


def _restricted_load(f: Any, **kwargs: Any) -> Any:
    return RestrictedUnpickler(f, **kwargs).load()


RESTRICTED = types.ModuleType("restricted_pickle")
RESTRICTED.Unpickler = RestrictedUnpickler  # type: ignore[attr-defined]
RESTRICTED.load = _restricted_load  # type: ignore[attr-defined]
RESTRICTED.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
_ALLOWED: dict[str, Any] = {}


def _error(e: BaseException) -> dict[str, Any]:
    text = f"{type(e).__name__}: {e}"
    return {
        "ok": False,
        "error": text[:2000],
        "unsafe": sorted(set(GLOBAL_RE.findall(text))),
    }


class Describer:
    """A JSON picture of a loaded tree: containers, scalars, and every tensor's layout."""

    def __init__(self, locations: dict[int, str], ranges: list[tuple[int, int, str]]) -> None:
        self.locations = locations
        self.ranges = ranges
        self.storages: dict[Any, int] = {}
        self.seen: set[int] = set()
        self.nodes = 0

    def device(self, t: Any) -> str:
        storage = t.untyped_storage()
        found = self.locations.get(storage._cdata)
        if found is not None:
            return found
        ptr = storage.data_ptr()
        for start, size, loc in self.ranges:
            if start <= ptr < start + max(size, 1):
                return loc
        return str(t.device)

    def rebuilt(self, t: Any) -> dict[str, Any]:
        """A sparse, meta or nested tensor, pictured as inspect lists it: no storage or offset
        of its own, its parts' storages' bytes, no strides but a meta tensor's."""
        import torch

        if t.is_nested:
            parts = [t, t._nested_tensor_size(), t._nested_tensor_strides()]
            parts.append(t._nested_tensor_storage_offsets())
            shape = [t.size(0)] + [-1] * (t.dim() - 1)
        else:
            shape = list(t.shape)
            parts = [t._indices(), t._values()] if t.layout == torch.sparse_coo else []
            if t.layout in (torch.sparse_csr, torch.sparse_bsr):
                parts = [t.crow_indices(), t.col_indices(), t.values()]
            elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
                parts = [t.ccol_indices(), t.row_indices(), t.values()]
        storages = {p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in parts}
        sid = len(self.storages)
        self.storages[("rebuilt", sid)] = sid  # shares with nothing
        return {
            "t": "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "layout": "nested" if t.is_nested else str(t.layout).removeprefix("torch."),
            "shape": shape,
            "stride": list(t.stride()) if t.is_meta else [],
            "offset": 0,
            "device": str(t.device),
            "storage": sid,
            "storage_nbytes": sum(storages.values()),
            "param": isinstance(t, torch.nn.Parameter),
        }

    def tensor(self, t: Any) -> dict[str, Any]:
        import torch

        if t.is_nested or t.is_meta or t.layout != torch.strided:
            return self.rebuilt(t)
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else ("empty", storage._cdata)
        sid = self.storages.setdefault(key, len(self.storages))
        nbytes = t.numel() * t.element_size()
        digest = None
        if nbytes <= MAX_HASH_BYTES and t.device.type == "cpu":
            try:
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                digest = hashlib.sha1(raw.numpy().tobytes()).hexdigest()
            except Exception as e:  # an exotic dtype numpy cannot hold
                digest = f"unhashable {type(e).__name__}"
        return {
            "t": "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": t.storage_offset(),
            "device": self.device(t),
            "storage": sid,
            "storage_nbytes": storage.nbytes(),
            "nbytes": nbytes,
            "sha": digest,
            "param": isinstance(t, torch.nn.Parameter),
        }

    def __call__(self, obj: Any, depth: int = 0) -> dict[str, Any]:
        import torch

        self.nodes += 1
        if self.nodes > MAX_NODES or depth > MAX_DEPTH:
            return {"t": "truncated"}
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, (dict, list, tuple, set, frozenset)):
            if id(obj) in self.seen:
                return {"t": "ref", "type": type(obj).__name__}
            self.seen.add(id(obj))
        if isinstance(obj, dict):
            items = [[key_picture(k), self(v, depth + 1)] for k, v in list(obj.items())]
            return {"t": "dict", "type": type(obj).__name__, "items": items}
        if isinstance(obj, (list, tuple)):
            kind = "tuple" if isinstance(obj, tuple) else "list"
            return {
                "t": kind,
                "type": type(obj).__name__,
                "items": [self(v, depth + 1) for v in obj],
            }
        return {"t": "scalar", "type": type(obj).__name__, "repr": safe_repr(obj)}


def safe_repr(obj: Any) -> str:
    try:
        return repr(obj)[:200]
    except Exception as e:  # a 5,000-digit int
        return f"<{type(obj).__name__}: {type(e).__name__}>"


def key_picture(k: Any) -> dict[str, Any]:
    try:
        text = str(k)[:500]
    except Exception:
        text = safe_repr(k)
    return {"type": type(k).__name__, "str": text}


def load_torch(path: str, **kwargs: Any) -> dict[str, Any]:
    import torch

    locations: dict[int, str] = {}
    ranges: list[tuple[int, int, str]] = []

    def record(storage: Any, location: str) -> Any:
        locations[storage._cdata] = location
        ranges.append((storage.data_ptr(), storage.nbytes(), location))
        return storage

    obj = torch.load(path, map_location=record, **kwargs)
    return {"ok": True, "tree": Describer(locations, ranges)(obj)}


# torch's weights-only unpickler implements fewer opcodes, and BUILD, SETITEM(S) and
# APPEND(S) on fewer objects (BUILD None on a plain dict, or an empty SETITEMS on a tensor,
# which mean nothing to the full one), than the full one; we read as the full one does, with
# the allowlist's globals only (README, Safety model).
NOT_ABOUT_SAFETY = (
    "legacy .tar format",
    "Unsupported operand",
    "Can only build",
    "Can only SETITEM",  # (and SETITEMS) "for dict, collections.OrderedDict, ..."
    "Can only append to lists",
    "Can only extend lists",
)


def torch_view(path: str, mmap: bool = False) -> dict[str, Any]:
    try:
        return load_torch(path, weights_only=True, mmap=mmap)
    except Exception as e:
        first = _error(e)
    if first["unsafe"] or not any(s in first["error"] for s in NOT_ABOUT_SAFETY):
        return first
    try:
        answer = load_torch(path, weights_only=False, pickle_module=RESTRICTED)
    except Exception as e:
        answer = _error(e)
    answer["via"] = "restricted"
    answer["weights_only_error"] = first["error"][:300]
    return answer


def safetensors_view(path: str) -> dict[str, Any]:
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
            items = []
            describe = Describer({}, [])
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                items.append([{"type": "str", "str": name}, describe.tensor(f.get_tensor(name))])
        tree = {"t": "dict", "type": "dict", "items": items}
        return {"ok": True, "tree": tree, "metadata": metadata}
    except BaseException as e:  # the Rust side can panic (PanicException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        return _error(e)


def pickle_view(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = RestrictedUnpickler(f).load()
        return {"ok": True, "tree": Describer({}, [])(obj)}
    except Exception as e:
        return _error(e)


def answer(request: dict[str, Any]) -> dict[str, Any]:
    path = request["path"]
    if "output" in request:
        return output_view(path, safetensors=request["output"] == "st")
    out: dict[str, Any] = {"torch": torch_view(path), "safetensors": safetensors_view(path)}
    with open(path, "rb") as f:
        head = f.read(2)
    if head[:1] and head[:1].decode("latin-1") in pickletools.code2op:  # any opcode may start one
        out["pickle"] = pickle_view(path)
    return out


def output_view(path: str, safetensors: bool) -> dict[str, Any]:
    """A file ckpt wrote (``{"output": "torch" | "st"}``): it must load without any fallback.

    torch: ``weights_only=True``, then again with ``mmap=True``; safetensors: ``safe_open``.
    """
    if safetensors:
        return {"safetensors": safetensors_view(path)}
    views = {}
    for name, mmap in (("torch", False), ("torch_mmap", True)):
        try:
            views[name] = load_torch(path, weights_only=True, mmap=mmap)
        except Exception as e:
            views[name] = _error(e)
    return views


def main() -> None:
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch  # noqa: F401  (paid once)

    _ALLOWED.update(_allowed())
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = answer(request)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            result = {"worker_error": _error(e)}
        channel.write(json.dumps(result, default=str) + "\n")
        channel.flush()


if __name__ == "__main__":
    sys.setrecursionlimit(10000)
    io.DEFAULT_BUFFER_SIZE = 1 << 16
    main()
