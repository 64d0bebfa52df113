"""``ckpt devices``."""

from __future__ import annotations

import click

from ckpt_tools.cli.options import json_option
from ckpt_tools.cli.render import echo_json, human_bytes, table


@click.command("devices")
@json_option
def devices_cmd(as_json: bool) -> None:
    """List the CPU and the visible GPUs (freest first), with total and free memory."""
    # Imported here: it needs torch, and `ckpt --help` lists this command without running it.
    from ckpt_tools.loading.extras import require_torch

    require_torch("ckpt devices")
    from ckpt_tools.loading.devices import list_devices

    devices = list_devices()
    if as_json:
        echo_json([d.to_json() for d in devices])
        return
    rows = [
        [
            d.device,
            d.name,
            human_bytes(d.total_memory) if d.total_memory is not None else "?",
            human_bytes(d.free_memory) if d.free_memory is not None else "?",
            d.visible_id if d.visible_id is not None else "",
        ]
        for d in devices
    ]
    click.echo(table(rows, ["device", "name", "total", "free", "CUDA_VISIBLE_DEVICES id"]))
