"""DCP checkpoints written by torch itself, for the consolidate tests and the benchmark.

``save_fsdp(folder, world)`` spawns ``world`` CPU processes (gloo), shards a tiny model with
FSDP2 (``fully_shard``), takes one Adam step and saves model and optimizer with
``torch.distributed.checkpoint.save``. Its first layer has fewer rows than 4, so at 4 ranks
a rank holds nothing of it. ``layouts=True`` also saves DTensors sharded on dim 1 and on a
2-D mesh (chunks that are not dim-0 slices). torch.distributed is used here, in tests only.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_model(dtype: Any) -> Any:
    """Two linears (3 and 5 rows: uneven over 2 and 4 ranks), an embedding, int/bool buffers."""
    import torch
    from torch import nn

    class Tiny(nn.Sequential):
        def forward(self, x: Any) -> Any:
            return self[2](self[1](self[0](x))).sum() + self[3].weight.sum()

    torch.manual_seed(0)
    model = Tiny(nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 5), nn.Embedding(7, 4))
    model.register_buffer("counts", torch.arange(6, dtype=torch.int64))
    model.register_buffer("mask", torch.tensor([True, False, True]))
    return model.to(dtype) if dtype is not None else model


def _worker(rank: int, world: int, folder: str, port: int, dtype_name: str, layouts: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        dtype = getattr(torch, dtype_name)
        model = tiny_model(dtype)
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model, mesh=mesh)
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        x = torch.randn(2, 8, dtype=dtype)
        model(x).float().backward()
        optim.step()
        model_sd, optim_sd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": 1}
        if layouts:
            torch.manual_seed(1)
            full = torch.randn(6, 10, dtype=dtype)
            state["extra"] = {"cols": distribute_tensor(full, mesh, [Shard(1)])}
            if world == 4:
                mesh2 = init_device_mesh("cpu", (2, 2))
                state["extra"]["grid"] = distribute_tensor(full * 2, mesh2, [Shard(0), Shard(1)])
                state["extra"]["grid_t"] = distribute_tensor(full.t(), mesh2, [Shard(1), Shard(0)])
        dcp.save(state, checkpoint_id=folder)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_fsdp(folder: Path, world: int, dtype: str = "float32", layouts: bool = False) -> Path:
    """Save an FSDP2 model and its Adam state with DCP from ``world`` spawned CPU processes."""
    import torch.multiprocessing as mp

    from ckpt_tools.harness.spawning import start_method

    args = (world, str(folder), free_port(), dtype, layouts)
    mp.start_processes(_worker, args=args, nprocs=world, start_method=start_method())
    return folder


def reference(folder: Path, out: Path) -> Any:
    """What torch's own converter makes of ``folder``: ``dcp_to_torch_save`` + ``torch.load``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)
