"""``ckpt inspect FILE``."""

from __future__ import annotations

import click

from ckpt_tools.cli.options import json_option, select_option
from ckpt_tools.cli.render import counts, echo_json, human_bytes, human_count, table
from ckpt_tools.structure.grouping import group_names
from ckpt_tools.ops.inspection import CheckpointInfo, TensorInfo, inspect


@click.command("inspect")
@click.argument("path", type=click.Path())
@select_option
@json_option
@click.option("--group", is_flag=True, help="Fold repeated layers: layers.{0..31}.fc.weight ×32.")
@click.option("--limit", type=int, default=None, help="Show at most this many table rows.")
def inspect_cmd(
    path: str, select: str | None, as_json: bool, group: bool, limit: int | None
) -> None:
    """Describe a checkpoint from its structure: never runs its pickle, never imports torch."""
    info = inspect(path, select=select)
    if as_json:
        echo_json(info.to_json())
        return
    click.echo(summary(info))
    click.echo("")
    click.echo(tensor_table(info, group=group, limit=limit))


def summary(info: CheckpointInfo) -> str:
    """The header block: format, selection, counts, dtypes, devices, wrappers, globals."""
    lines = [
        f"file:        {info.path}",
        f"format:      {info.format}" + (f" ({len(info.shards)} shards)" if info.shards else ""),
        f"state dict:  {'.'.join(info.selected) or '<root>'} ({info.selection_reason})",
        f"tensors:     {len(info.tensors)}",
        f"parameters:  {human_count(info.total_params)} ({info.total_params})",
        f"bytes:       {human_bytes(info.total_bytes)}"
        + (
            f" ({human_bytes(info.storage_bytes)} in distinct storages)"
            if info.storage_bytes != info.total_bytes
            else ""
        ),
        f"dtypes:      {counts(info.dtypes)}",
        f"devices:     {counts(info.devices)}",
    ]
    if info.wrappers:
        found = "; ".join(
            f"{w.prefix!r} {w.kind} ({w.count}/{w.of} keys{', inside keys' if w.inner else ''})"
            for w in info.wrappers
        )
        lines.append(f"wrappers:    {found}")
        lines.append(f"             strip them: ckpt strip-module {info.path} OUT")
    else:
        lines.append("wrappers:    none")
    if info.unsafe_globals:
        lines.append(
            f"unsafe:      {', '.join(info.unsafe_globals)} (outside the allowlist; never imported)"
        )
    if info.entries:
        lines.append("other entries:")
        for key, text in list(info.entries.items())[:20]:
            lines.append(f"  {key}: {text}")
        if len(info.entries) > 20:
            lines.append(f"  ... {len(info.entries) - 20} more (see --json)")
    return "\n".join(lines)


def tensor_table(info: CheckpointInfo, group: bool = False, limit: int | None = None) -> str:
    """The tensor table, optionally with repeated layers folded."""
    headers = ["name", "dtype", "shape", "device", "storage", "offset", "bytes", "shared with"]

    def row(name: str, t: TensorInfo, count: int) -> list[str]:
        shared = ", ".join(t.shared_with[:2]) + (" ..." if len(t.shared_with) > 2 else "")
        return [
            name + (f" ×{count}" if count > 1 else ""),
            t.dtype,
            "[" + ", ".join(map(str, t.shape)) + "]",
            t.device,
            t.storage if count == 1 else "",
            str(t.offset) if count == 1 else "",
            human_bytes(t.nbytes * count),
            shared if count == 1 else "",
        ]

    if group:
        groups = group_names(info.tensors, lambda t: t.name, lambda t: (t.dtype, t.shape, t.device))
        rows = [row(g.pattern, members[0], g.count) for g, members in groups]
    else:
        rows = [row(t.name, t, 1) for t in info.tensors]
    hidden = 0
    if limit is not None and len(rows) > limit:
        hidden, rows = len(rows) - limit, rows[:limit]
    text = table(rows, headers)
    return text + (f"\n... {hidden} more rows (drop --limit)" if hidden else "")
