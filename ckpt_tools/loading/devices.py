"""Which devices this machine has, which GPUs are the freest, and where saved storages go.

``torch.cuda.mem_get_info`` reports free memory as the driver sees it, so memory held by
other processes counts. Querying it creates a CUDA context on each GPU, which holds GPU
memory of its own: fine in a launcher or a CLI, worth knowing in a long-lived process.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckpt_tools._types import MapLocation
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.loading.extras import require_torch

if TYPE_CHECKING:
    import torch

__all__ = [
    "DeviceInfo",
    "MapLocation",
    "auto_location",
    "checked_device",
    "list_devices",
    "pick_devices",
    "resolve_map_location",
    "visible_devices_for",
]


@dataclass(frozen=True)
class DeviceInfo:
    """One device.

    Attributes:
        device: its torch name (``cpu``, ``cuda:1``, ``mps``).
        name: the product name (``NVIDIA H100 80GB HBM3``) or the CPU model.
        total_memory: bytes, or None when unknown.
        free_memory: bytes free now, or None when unknown.
        visible_id: for GPUs, the entry to put in ``CUDA_VISIBLE_DEVICES`` (the physical
            index or UUID this process sees as ``cuda:N``).
        capability: CUDA compute capability, for GPUs.
    """

    device: str
    name: str
    total_memory: int | None = None
    free_memory: int | None = None
    visible_id: str | None = None
    capability: tuple[int, int] | None = None

    @property
    def type(self) -> str:
        return self.device.partition(":")[0]

    @property
    def index(self) -> int | None:
        _, _, index = self.device.partition(":")
        return int(index) if index else None

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "name": self.name,
            "total_memory": self.total_memory,
            "free_memory": self.free_memory,
            "visible_id": self.visible_id,
            "capability": list(self.capability) if self.capability else None,
        }


def _cpu() -> DeviceInfo:
    name = platform.processor() or platform.machine()
    total = free = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as f:
            info = {k: v for k, _, v in (line.partition(":") for line in f)}
        total = int(info["MemTotal"].split()[0]) * 1024
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
    cores = os.cpu_count() or 1
    return DeviceInfo("cpu", f"{name} ({cores} cores)", total, free)


def _visible_ids(count: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entry of each ``cuda:N`` this process sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(count)]
    entries = [e.strip() for e in env.split(",") if e.strip()]
    return [entries[i] if i < len(entries) else str(i) for i in range(count)]


def _gpus() -> list[DeviceInfo]:
    import torch

    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    ids = _visible_ids(count)
    found = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        found.append(
            DeviceInfo(
                f"cuda:{i}",
                props.name,
                int(total),
                int(free),
                ids[i],
                (props.major, props.minor),
            )
        )
    # Freest first; ties keep the lower index so the order is stable.
    found.sort(key=lambda d: (-(d.free_memory or 0), d.index or 0))
    return found


def list_devices() -> tuple[DeviceInfo, ...]:
    """Every visible GPU, freest first, then MPS when present, then the CPU.

    Returns:
        The devices; the CPU is always last and always there.

    Raises:
        MissingExtraError: torch is not installed (``pip install 'ckpt_tools[torch]'``).

    Example:
        >>> list_devices()[-1].device
        'cpu'
    """
    torch = require_torch("list_devices")
    devices = _gpus()
    if torch.backends.mps.is_available():
        total = getattr(torch.mps, "recommended_max_memory", lambda: None)()
        devices.append(DeviceInfo("mps", "Apple MPS", total))
    devices.append(_cpu())
    return tuple(devices)


def _freest(n: int) -> list[DeviceInfo]:
    if n < 1:
        raise UsageError(f"asked for {n} GPUs; ask for at least 1")
    gpus = _gpus()
    if gpus and n > len(gpus):
        raise UsageError(
            f"asked for {n} GPUs but {len(gpus)} are visible "
            f"({', '.join(d.device for d in gpus)}); ask for at most {len(gpus)}"
        )
    return gpus[:n]


def pick_devices(*, count: int = 1) -> list[torch.device]:
    """The ``count`` GPUs with the most free memory, freest first; ``[cpu]`` when there is none.

    Args:
        count: how many GPUs.

    Returns:
        ``torch.device("cuda", i)`` for each, or ``[torch.device("cpu")]`` without GPUs.

    Raises:
        UsageError: ``count`` < 1, or more GPUs asked for than are visible.

    Example:
        >>> import torch
        >>> pick_devices() if not torch.cuda.is_available() else [torch.device("cpu")]
        [device(type='cpu')]
    """
    torch = require_torch("pick_devices")
    gpus = _freest(count)
    if not gpus:
        return [torch.device("cpu")]
    return [torch.device("cuda", d.index) for d in gpus]


def visible_devices_for(n: int = 1) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value exposing the ``n`` freest GPUs, freest first.

    Set it in a child process's environment (it has no effect once CUDA is initialised
    in this one). Entries are translated through this process's own
    ``CUDA_VISIBLE_DEVICES``, so the value names physical GPUs (or UUIDs).

    Args:
        n: how many GPUs.

    Returns:
        E.g. ``"3,1"``; ``""`` (hide every GPU) when there is none.

    Raises:
        UsageError: ``n`` < 1, or more GPUs asked for than are visible.

    Example:
        >>> env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_devices_for(1)}  # "" without GPUs
        >>> visible_devices_for(0)
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: asked for 0 GPUs; ask for at least 1
    """
    require_torch("visible_devices_for")
    return ",".join(d.visible_id or str(d.index) for d in _freest(n))


# ---------------------------------------------------------------------------------------
# Where saved storages go (``map_location``)


def _device_available(device: torch.device) -> bool:
    import torch

    if device.type in ("cpu", "meta"):
        return True
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if module is None or is_available is None or not is_available():
        return False
    count = getattr(module, "device_count", None)
    return device.index is None or count is None or device.index < count()


def auto_location(tag: str) -> str:
    """Where ``"auto"`` puts a storage saved under ``tag``.

    The saved device when it exists here; ``cuda:N`` past the visible GPUs goes to
    ``cuda:{N % count}``; a backend that is absent here (CUDA on a CPU-only machine, MPS
    elsewhere) goes to the CPU.

    Args:
        tag: a saved location tag (``cpu``, ``cuda``, ``cuda:1``, ``mps``).

    Returns:
        A device string torch accepts.

    Example:
        >>> auto_location("cpu")
        'cpu'
    """
    torch = require_torch("auto_location")
    try:
        device = torch.device(tag)
    except RuntimeError:
        return "cpu"
    if device.type in ("cpu", "meta"):
        return device.type
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    if module is None or is_available is None or not is_available():
        return "cpu"
    count_fn = getattr(module, "device_count", None)
    count = count_fn() if count_fn is not None else 1
    if count < 1:
        return "cpu"
    if device.index is None:
        return f"{device.type}:0" if count_fn is not None else device.type
    return f"{device.type}:{device.index % count}"


def resolve_map_location(map_location: MapLocation, tags: Sequence[str]) -> dict[str, str] | None:
    """Where each saved tag goes, for every ``map_location`` form except callables.

    Args:
        map_location: ``"auto"``, ``None`` (where saved), a device string or
            ``torch.device``, a dict tag -> tag (unlisted tags stay), or a callable.
        tags: the saved tags of the checkpoint's storages.

    Returns:
        tag -> device string; None for a callable (known only once called).

    Raises:
        UsageError: a target device is malformed, does not exist here, is the CPU or meta
            with an index (``'cpu:0'``: torch restores only to ``'cpu'``), or a dict's
            target is not a string (torch.load raises TypeError on a ``torch.device``).

    Example:
        >>> resolve_map_location("auto", ["cpu"])
        {'cpu': 'cpu'}
    """
    torch = require_torch("resolve_map_location")
    if callable(map_location) and not isinstance(map_location, (str, torch.device, Mapping)):
        return None
    resolved: dict[str, str] = {}
    for tag in dict.fromkeys(tags):
        if isinstance(map_location, str) and map_location == "auto":
            resolved[tag] = auto_location(tag)
            continue
        if map_location is None:
            target: Any = tag
        elif isinstance(map_location, Mapping):
            target = map_location.get(tag, tag)
            if not isinstance(target, str):
                # torch.load parses a dict's targets as text: it raises TypeError on others.
                raise _refused(
                    f"{target!r}; torch.load takes a dict's targets only as strings",
                    tag,
                    map_location,
                    Remedy("map_location", repr({tag: str(target)})),
                )
        elif isinstance(map_location, (str, torch.device)):
            target = map_location
        else:
            raise UsageError(
                "not a device, a dict of tags, a callable or 'auto'",
                argument="map_location",
                value=repr(map_location),
            )
        resolved[tag] = checked_device(target, tag, map_location)
    return resolved


def checked_device(target: Any, tag: str, map_location: MapLocation) -> str:
    """``target`` as a device string torch restores to, or the refusal that names it."""
    import torch

    try:
        device = torch.device(target)
    except (RuntimeError, TypeError) as e:
        raise _refused(
            f"{target!r}, which is not a device (expected 'cpu', 'cuda:0', ...)",
            tag,
            map_location,
            Remedy("map_location", "'auto'"),
        ) from e
    if device.type in ("cpu", "meta") and device.index is not None:
        # torch restores CPU and meta storages only under the bare tag: 'cpu:0' fails
        # inside it ('meta:0' too, but for a torch.device given for a whole zip file).
        raise _refused(
            f"{str(device)!r}; torch takes the {device.type} device only as "
            f"{device.type!r}, without an index",
            tag,
            map_location,
            Remedy("map_location", repr(device.type)),
        )
    if not _device_available(device):
        raise _refused(
            f"{str(device)!r}, which does not exist here (visible: {_visible()})",
            tag,
            map_location,
            Remedy("map_location", "'auto'", text="to put each storage on an existing device"),
            Remedy("map_location", "'cpu'"),
        )
    return str(device)


def _refused(where: str, tag: str, map_location: MapLocation, *remedies: Remedy) -> UsageError:
    """The refusal of a ``map_location`` that sends ``tag`` to ``where`` (the device, and
    what is wrong with it)."""
    return UsageError(
        f"sends storages saved on {tag!r} to {where}",
        argument="map_location",
        value=repr(map_location),
        remedies=remedies,
    )


def _visible() -> str:
    import torch

    names = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return ", ".join(names)
