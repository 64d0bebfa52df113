"""What :func:`~.inspection.inspect` returns: :class:`CheckpointInfo`, torch-free.

Its text (``str(info)``) is what ``ckpt inspect`` prints: the command renders through
:meth:`CheckpointInfo.text`, only choosing the table format.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools._escape import shell_path
from ckpt_tools.errors import Remedy, ResourceLimitError, SelectError, shown
from ckpt_tools.ops.inspect.tensor_info import TensorInfo, group_sharing, table_row
from ckpt_tools.structure.steps import Step, fix_command
from ckpt_tools.structure.text import (
    Readable,
    TableFormat,
    TensorsByName,
    close_matches,
    counts,
    human_bytes,
    human_count,
    more_hint,
    text_table,
)
from ckpt_tools.structure.wrappers import WrapperMatch

__all__ = ["MAX_SHARED_NAMES", "TENSOR_COLUMNS", "CheckpointInfo", "TensorInfo"]

#: The columns of :meth:`CheckpointInfo.table` (and of ``ckpt inspect``'s table).
TENSOR_COLUMNS = ("name", "dtype", "shape", "device", "storage", "offset", "bytes", "shared with")
# The chunk table of a DCP folder: each saved piece of a tensor and where its archive lies.
CHUNK_COLUMNS = ("chunk of", "offsets", "sizes", "file", "at byte", "length")
# Entries beside the state dict shown in the text; ``--json`` has them all.
_ENTRIES_SHOWN = 20
#: The most names :meth:`CheckpointInfo.to_json` lists under ``shared_with``, all tensors
#: together: n views of one storage list n * (n - 1) names, which no memory holds for large n.
MAX_SHARED_NAMES = 1 << 22
_SHARING_SHOWN = "(the table's storage column shows which tensors share memory)"


@dataclass(frozen=True)
class CheckpointInfo(Readable, TensorsByName[TensorInfo]):
    """The result of :func:`inspect`: a container of :class:`TensorInfo` by name.

    ``info.tensor("fc.weight")``, ``"fc.weight" in info``, ``len(info)`` and
    ``for t in info`` look up, count and walk the selected state dict's tensors;
    ``print(info)`` shows what ``ckpt inspect`` shows.

    Attributes:
        path: the file or folder.
        format: see :data:`ckpt_tools.formats.FORMATS`.
        selected: keys leading to the chosen state dict (``()`` for the root).
        selection_reason: why it was chosen.
        tensors: the state dict's tensors, in key order.
        wrappers: wrapper prefixes found in its keys.
        unsafe_globals: globals outside the allowlist (never imported).
        entries: non-tensor entries beside the state dict, summarised (``{"epoch": "int 3"}``),
            plus non-tensor values inside it.
        total_params: elements over all tensors.
        total_bytes: bytes over all tensors.
        storage_bytes: bytes of the distinct storages they view (shared memory counted once).
        metadata: safetensors ``__metadata__`` or a shard index's ``metadata``.
        shards: shard file names, for sharded folders.
        shard_of: tensor name -> ``"shard file:"``, for sharded folders.
        pickle_protocol: the main pickle's protocol (0 for formats without one).
        beyond_weights_only: its opcodes that ``torch.load(weights_only=True)`` lacks.
        pickled_module: when the state dict was recovered from a pickled ``nn.Module``
            (``torch.save(model)``): ``{"class", "modules", "tensors", "caveats"}``.
        chunks: tensor name -> its saved chunks (``offsets``, ``sizes``, ``file``,
            ``offset``, ``length``), for DCP folders.
        format_info: the format's own record, as ``lines()`` and ``to_json()`` (``ZeroInfo``).
        transfer: for a checkpoint read from a URL, the
            :class:`~ckpt_tools.io.remote.TransferStats` of the read.
        select: the ``select`` it was inspected with (None: the file's own choice), which
            the rewrite it suggests repeats.
    """

    path: str
    format: str
    selected: tuple[str, ...]
    selection_reason: str
    tensors: tuple[TensorInfo, ...]
    wrappers: tuple[WrapperMatch, ...]
    unsafe_globals: tuple[str, ...]
    entries: Mapping[str, str]
    total_params: int
    total_bytes: int
    storage_bytes: int
    metadata: Mapping[str, str] | None = None
    shards: tuple[str, ...] = ()
    shard_of: Mapping[str, str] = field(default_factory=dict)
    pickle_protocol: int = 0
    beyond_weights_only: tuple[str, ...] = ()
    pickled_module: Mapping[str, Any] | None = None
    chunks: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    format_info: Any = None
    # What reading it from a URL cost (requests, bytes received); None for a local file.
    # Not part of to_json(): the description of a file is the same wherever it lies.
    transfer: Any = None
    select: str | tuple[str, ...] | None = None

    @property
    def dtypes(self) -> dict[str, int]:
        """dtype -> tensor count."""
        return dict(Counter(t.dtype for t in self.tensors))

    @property
    def devices(self) -> dict[str, int]:
        """saved device tag -> tensor count."""
        return dict(Counter(t.device for t in self.tensors))

    # --- lookups ------------------------------------------------------------------------

    def tensor(self, name: str) -> TensorInfo:
        """The tensor saved under ``name``.

        Args:
            name: its key in the selected state dict.

        Returns:
            Its :class:`TensorInfo`.

        Raises:
            SelectError: no such tensor (a ``KeyError``); the message names close matches.

        Example:
            >>> from ckpt_tools import inspect
            >>> inspect("ddp.pt").tensor("module.head.bias").shape
            (3,)
            >>> inspect("ddp.pt").tensor("conv.weight")
            Traceback (most recent call last):
            ckpt_tools.errors.SelectError: no tensor 'conv.weight' in ddp.pt (close: ...); ...
        """
        found = self._by_name.get(name)
        if found is None:
            near = close_matches(name, self._by_name)
            raise SelectError(
                shown(f"no tensor {name!r} in {self.path}")
                + (f" (close: {shown(', '.join(near))})" if near else ""),
                path=self.path,
                remedies=tuple(Remedy("name", repr(n), text="(a close match)") for n in near),
            )
        return found

    # --- text ---------------------------------------------------------------------------

    def summary(self, for_cli: bool = False) -> str:
        """The header block: format, selection, counts, dtypes, devices, wrappers, globals.

        Args:
            for_cli: word hints for the ``ckpt`` command (``--json``, ``ckpt strip-module``)
                instead of for Python.
        """
        spread = self.storage_bytes != self.total_bytes
        lines = [
            f"file:        {self.path}",
            f"format:      {self.format}"
            + (f" ({len(self.shards)} shard{'s' * (len(self.shards) > 1)})" if self.shards else ""),
            f"state dict:  {'.'.join(self.selected) or '<root>'} ({self.selection_reason})",
            f"tensors:     {len(self.tensors)}",
            f"parameters:  {human_count(self.total_params)} ({self.total_params})",
            f"bytes:       {human_bytes(self.total_bytes)}"
            + (f" ({human_bytes(self.storage_bytes)} in distinct storages)" if spread else ""),
            f"dtypes:      {counts(self.dtypes)}",
            f"devices:     {counts(self.devices)}",
            *self._wrapper_lines(for_cli),
            *(self.format_info.lines() if self.format_info is not None else ()),
        ]
        if self.pickled_module:
            lines += [f"caveat:      {c}" for c in self.pickled_module["caveats"]]
        if self.unsafe_globals:
            verdict = (
                f"ckpt scan {shell_path(self.path)}"
                if for_cli
                else f"ckpt_tools.scan({self.path!r})"
            )
            lines.append(
                f"unsafe:      {', '.join(self.unsafe_globals)} (outside the allowlist; "
                f"never imported): `{verdict}` says whether loading it can run code"
            )
        if self.beyond_weights_only:
            lines.append(self._pickle_line(for_cli))
        if self.entries:
            lines.append("other entries:")
            lines += [f"  {k}: {v}" for k, v in list(self.entries.items())[:_ENTRIES_SHOWN]]
            if len(self.entries) > _ENTRIES_SHOWN:
                lines.append("  " + more_hint(len(self.entries) - _ENTRIES_SHOWN, for_cli))
        # Each line shown: a name with a line break (a key, a global, the path) stays in its line.
        return "\n".join(map(shown, lines))

    def _wrapper_lines(self, for_cli: bool) -> list[str]:
        if not self.wrappers:
            return ["wrappers:    none"]
        if for_cli:
            # The command diff suggests too: quoted for the shell, with the --select given.
            steps = [Step("strip-inner" if w.inner else "strip", w.prefix) for w in self.wrappers]
            keys = [t.name for t in self.tensors]
            needs = {"allow_globals": self.unsafe_globals, "recovered": bool(self.pickled_module)}
            fix = fix_command(self.path, steps, self.select, keys, **needs, fmt=self.format)
        else:
            fix = self._strip_call()
        if not fix:  # TorchScript: no rewrite writes it
            fix = "torch.jit.load it and save its state_dict() (its code names these keys)"
        found = "; ".join(
            f"{w.prefix!r} {w.kind} ({w.count}/{w.of} keys{', inside keys' if w.inner else ''})"
            for w in self.wrappers
        )
        return [
            f"wrappers:    {found}",
            f"             strip them: {fix}",
        ]

    def _strip_call(self) -> str:
        """The Python form of the fix: the call that strips every wrapper found."""
        chosen = "" if self.select is None else f", select={self.select!r}"
        if self.format == "dcp":
            return f"ckpt_tools.consolidate({self.path!r}, 'OUT.pt', strip=True{chosen})"
        if self.format == "torchscript":
            return ""
        if self.unsafe_globals:
            chosen += f", allow_globals={list(self.unsafe_globals)!r}"
        if self.pickled_module:
            chosen += ", drop_extras=True"
            return f"ckpt_tools.strip_module({self.path!r}, 'OUT.safetensors'{chosen})"
        return f"ckpt_tools.strip_module({self.path!r}, OUT{chosen})"

    def rows(self, group: bool = False) -> list[list[str]]:
        """The tensor table's cells, one row per tensor (or per folded group), under
        :data:`TENSOR_COLUMNS`."""
        if not group:
            return [table_row(t.name, t, [t], None) for t in self.tensors]
        from ckpt_tools.structure.grouping import group_names  # only --group folds

        # A layout apart: a sparse and a dense tensor of one shape are no repeated layer.
        groups = group_names(
            self.tensors, lambda t: t.name, lambda t: (t.dtype, t.layout, t.shape, t.device)
        )
        return [
            table_row(g.label, members[0], members, group_sharing(members) if g.count > 1 else None)
            for g, members in groups
        ]

    def table(
        self,
        group: bool = False,
        limit: int | None = None,
        table: TableFormat = text_table,
        for_cli: bool = False,
    ) -> str:
        """The tensor table.

        Args:
            group: fold repeated layers (``layers.{0..31}.fc.weight ×32``).
            limit: show at most this many rows, and say how many were left out.
            table: formats the rows (the ``ckpt`` command passes its tabulate table).
            for_cli: word the "more rows" hint for the command (``--limit``).
        """
        return _limited(self.rows(group), TENSOR_COLUMNS, limit, table, "rows", for_cli)

    def text(
        self,
        group: bool = False,
        limit: int | None = None,
        table: TableFormat = text_table,
        for_cli: bool = False,
    ) -> str:
        """The summary, a blank line, the tensor table: what ``ckpt inspect`` prints.

        Args:
            group, limit, table, for_cli: as :meth:`table` and :meth:`summary` take them.

        Example:
            >>> from ckpt_tools import inspect
            >>> print(inspect("model.pt").text(group=True))
            file:        model.pt
            format:      torch-zip
            state dict:  <root> (the root is a state dict)
            ...
        """
        text = f"{self.summary(for_cli)}\n\n{self.table(group, limit, table, for_cli)}"
        if self.chunks:
            text += "\n\n" + self.chunk_table(limit, table, for_cli)
        return text

    def chunk_table(
        self, limit: int | None = None, table: TableFormat = text_table, for_cli: bool = False
    ) -> str:
        """The DCP chunks of the selected tensors: where each piece lies, file and bytes.

        Args:
            limit, table, for_cli: as :meth:`table` takes them.
        """
        rows = [
            [name, list(c["offsets"]), list(c["sizes"]), c["file"], c["offset"], c["length"]]
            for name, chunks in self.chunks.items()
            for c in chunks
        ]
        return _limited(rows, CHUNK_COLUMNS, limit, table, "chunks", for_cli)

    def __repr__(self) -> str:
        return (
            f"CheckpointInfo(path={self.path!r}, format={self.format!r}, "
            f"selected={'.'.join(self.selected)!r}, tensors={len(self.tensors)}, "
            f"total_params={self.total_params})"
        )

    def _pickle_line(self, for_cli: bool) -> str:
        """What torch lacks to read the pickle, and the rewrite that makes one it reads."""
        # An int of 256 bytes or more has no opcode but LONG4: a torch file keeps it, so
        # only the tensors alone (safetensors) load.
        big = "LONG4" in self.beyond_weights_only
        path, out = shell_path(self.path), "OUT.safetensors" if big else "OUT.pt"
        if for_cli:
            fix = f"ckpt convert {path} {out}" + (" --drop-extras" if big else "")
        else:
            fix = f"ckpt_tools.convert({self.path!r}, {out!r}" + (
                ", drop_extras=True)" if big else ")"
            )
        why = "; an int of 256 bytes or more has no opcode it reads" if big else ""
        return (
            f"pickle:      protocol {self.pickle_protocol} with opcodes torch.load("
            f"weights_only=True) lacks ({', '.join(self.beyond_weights_only[:4])}): torch "
            f"refuses this file{why}; `{fix}` writes "
            + ("its tensors alone" if big else "one it reads")
        )

    def to_json(self) -> dict[str, Any]:
        """The public ``ckpt inspect --json`` schema (stable fields, plus extras).

        Raises:
            ResourceLimitError: the ``shared_with`` lists would name more than
                :data:`MAX_SHARED_NAMES` keys in all (thousands of views of one storage).
        """
        _check_shared_names(self.tensors, self.path)
        return {
            "path": self.path,
            "format": self.format,
            "selected": list(self.selected),
            "selection_reason": self.selection_reason,
            "tensors": [t.to_json() for t in self.tensors],
            "wrappers": [w.to_json() for w in self.wrappers],
            "unsafe_globals": list(self.unsafe_globals),
            "entries": dict(self.entries),
            "total_params": self.total_params,
            "total_bytes": self.total_bytes,
            "storage_bytes": self.storage_bytes,
            "dtypes": self.dtypes,
            "devices": self.devices,
            "metadata": dict(self.metadata) if self.metadata else None,
            "shards": list(self.shards),
            "pickle_protocol": self.pickle_protocol,
            "beyond_weights_only": list(self.beyond_weights_only),
            "pickled_module": dict(self.pickled_module) if self.pickled_module else None,
            "format_info": self.format_info and self.format_info.to_json(),
            "chunks": {
                name: [
                    {k: list(v) if isinstance(v, tuple) else v for k, v in c.items()} for c in cs
                ]
                for name, cs in self.chunks.items()
            },
        }


def _check_shared_names(tensors: tuple[TensorInfo, ...], path: str) -> None:
    listed = sum(len(t.sharing) - 1 for t in tensors if t.sharing)
    if listed > MAX_SHARED_NAMES:
        widest = max(len(t.sharing) for t in tensors)
        raise ResourceLimitError(
            f"{path}: {widest} tensors view one storage, so their shared_with lists would "
            f"name {listed:,} keys (the limit is {MAX_SHARED_NAMES:,})",
            path=path,
            remedies=(Remedy(flag="--json", verb="leave out", text=_SHARING_SHOWN),),
        )


def _limited(
    rows: list[list[Any]],
    columns: Sequence[str],
    limit: int | None,
    table: TableFormat,
    what: str,
    for_cli: bool,
) -> str:
    """``rows`` as a table of at most ``limit`` rows, and a line saying how many were left out
    and how to show them."""
    hidden = len(rows) - limit if limit is not None and len(rows) > limit else 0
    text = table(rows[: len(rows) - hidden], columns)
    drop = "drop --limit" if for_cli else "raise limit="
    return text + (f"\n... {hidden} more {what} ({drop})" if hidden else "")
