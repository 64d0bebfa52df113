"""Which devices a harness run uses: all GPUs, a chosen list, the freest ones, or the CPU.

With no CUDA device visible every strategy runs on the CPU (DDP as CPU processes over
gloo, the manual loop over CPU replicas), so the device list is then ``world_size`` times
``cpu``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from ckpt_tools._types import ascii_int
from ckpt_tools.errors import Remedy, UsageError
from ckpt_tools.loading.devices import pick_devices

__all__ = ["DEFAULT_CPU_WORLD_SIZE", "one_thread", "parse_gpus", "resolve_devices"]

#: World size when none is given and there is no GPU to count.
DEFAULT_CPU_WORLD_SIZE = 2

GpuSpec = str | Sequence[int] | None


def _pick(n: int) -> list[int]:
    """Indices of the ``n`` GPUs with the most free memory.

    See :func:`ckpt_tools.loading.devices.pick_devices`.
    """
    picked = pick_devices(count=n)
    if any(d.type != "cuda" for d in picked):  # pick_devices() falls back to [cpu] without GPUs
        raise UsageError(
            "found no GPU to pick", argument="gpus", value=repr(f"auto:{n}"), flag="--gpus"
        )
    return [d.index or 0 for d in picked]


def parse_gpus(gpus: GpuSpec, world_size: int | None = None) -> list[int]:
    """Turn a GPU selection into a list of CUDA device indices.

    Args:
        gpus: ``None`` (every visible GPU), ``"0,3"``, ``"auto:2"`` (the two GPUs with the
            most free memory), ``"auto"`` (``world_size`` freest GPUs, or all) or a
            sequence of indices.
        world_size: how many devices the run wants, used by plain ``"auto"``.

    Returns:
        Distinct device indices, in the order given.

    Raises:
        UsageError: malformed spec, an index that is not visible, or a repeated index.

    Example:
        >>> parse_gpus("0,3")  # on a machine with 4 GPUs  # doctest: +SKIP
        [0, 3]
        >>> parse_gpus("first two")
        Traceback (most recent call last):
        ...
        ckpt_tools.errors.UsageError: gpus='first two': expected comma-separated indices ...
    """
    count = torch.cuda.device_count()
    if gpus is None:
        return list(range(count))
    if isinstance(gpus, str):
        spec = gpus.strip().lower()
        if spec.startswith("auto"):
            rest = spec[len("auto") :]
            if rest == "":
                return _pick(world_size if world_size is not None else count)
            wanted = ascii_int(rest[1:]) if rest.startswith(":") else None
            if wanted is None or wanted < 1:
                raise UsageError(
                    "expected 'auto', 'auto:N' or '0,3'",
                    argument="gpus",
                    value=repr(gpus),
                    flag="--gpus",
                )
            return _pick(wanted)
        try:
            ids = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise UsageError(
                "expected comma-separated indices like '0,3', or 'auto:N'",
                argument="gpus",
                value=repr(gpus),
                flag="--gpus",
            ) from None
    else:
        ids = [int(i) for i in gpus]
    if not ids:
        raise UsageError("selects no GPU", argument="gpus", value=repr(gpus), flag="--gpus")
    bad = [i for i in ids if not 0 <= i < count]
    if bad:
        raise UsageError(
            f"indices {bad} are not among the {count} visible GPUs",
            argument="gpus",
            value=repr(gpus),
            flag="--gpus",
        )
    if len(set(ids)) != len(ids):
        raise UsageError(
            "repeats a GPU; each rank needs its own device",
            argument="gpus",
            value=repr(gpus),
            flag="--gpus",
        )
    return ids


def resolve_devices(
    world_size: int | None, gpus: GpuSpec = None, device: str | None = None
) -> list[torch.device]:
    """The device of every replica/rank of a run.

    Args:
        world_size: number of replicas/ranks; ``None`` means one per selected GPU, or
            :data:`DEFAULT_CPU_WORLD_SIZE` on the CPU.
        gpus: GPU selection, see :func:`parse_gpus`.
        device: ``"cpu"`` forces the CPU even when GPUs are visible; ``"cuda"`` insists
            on GPUs; ``None`` uses GPUs when there are any.

    Returns:
        ``world_size`` devices; on the CPU, the same ``cpu`` device repeated.

    Raises:
        UsageError: a world size below 1, more ranks than selected GPUs, GPUs asked for
            where none is visible, or ``device`` other than cpu/cuda.

    Example:
        >>> resolve_devices(2, device="cpu")
        [device(type='cpu'), device(type='cpu')]
    """
    if world_size is not None and world_size < 1:
        raise UsageError(
            "must be at least 1",
            argument="world_size",
            value=repr(world_size),
            flag="--world-size",
        )
    if device not in (None, "cpu", "cuda"):
        raise UsageError(
            "expected 'cpu' or 'cuda'", argument="device", value=repr(device), flag="--device"
        )
    if device == "cpu":
        if gpus is not None:
            raise UsageError(
                f"the GPUs {gpus!r} and the 'cpu' device contradict each other",
                argument="gpus",
                remedies=(
                    Remedy("gpus", verb="drop", flag="--gpus"),
                    Remedy("device", verb="drop", flag="--device"),
                ),
            )
        return [torch.device("cpu")] * (world_size or DEFAULT_CPU_WORLD_SIZE)
    if not torch.cuda.is_available():
        if device == "cuda" or gpus is not None:
            raise UsageError(
                f"no CUDA device is visible, but the run asks for GPUs (GPUs {gpus!r}, "
                f"device {device!r})",
                # Only what the next run accepts: GPUs and the 'cpu' device contradict.
                remedies=(
                    (Remedy("gpus", verb="leave out", flag="--gpus"),)
                    if gpus is not None
                    else (Remedy("device", "'cpu'", flag="--device cpu"),)
                ),
            )
        return [torch.device("cpu")] * (world_size or DEFAULT_CPU_WORLD_SIZE)
    ids = parse_gpus(gpus, world_size)
    if world_size is None:
        world_size = len(ids)
    if world_size > len(ids):
        raise UsageError(
            f"needs {world_size} GPUs, but only {len(ids)} are selected ({ids})",
            argument="world_size",
            value=repr(world_size),
            flag="--world-size",
            remedies=(
                Remedy("world_size", verb="lower", flag="--world-size"),
                Remedy("gpus", verb="select more with", flag="--gpus"),
                Remedy("device", "'cpu'", flag="--device cpu"),
            ),
        )
    return [torch.device("cuda", i) for i in ids[:world_size]]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one CPU thread while inside, as every spawned rank runs: runs compared by
    parity then sum in the same order (a BatchNorm's statistics on two threads differ in
    their last bits, and steps carry that on).

    Example:
        >>> with one_thread():
        ...     torch.get_num_threads()
        1
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
