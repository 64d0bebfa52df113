"""The two sides of a diff: names -> tensor descriptors (a file's or a URL's) or tensors (a
state dict's, a module's), and how each tensor's elements are streamed.

A file side is opened by its structure alone (:func:`~ckpt_tools.io.remote.checkpoint.open_path`:
a local file, or a URL read by byte ranges); its tensors are read, through a
:class:`~ckpt_tools.loading.tensor_io.TensorReader`, only when values are compared, so a diff of
two files without values imports no torch.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Union

from ckpt_tools._types import Select
from ckpt_tools.descriptors import RebuiltTensor, TensorRef
from ckpt_tools.diffing.entries import (
    Foreign,
    is_uninitialized,
    local_tensors,
    metadata_of,
    split_entries,
)
from ckpt_tools.diffing.parts import SideInfo, is_file
from ckpt_tools.diffing.refusals import refuse_deeper_tensors, refuse_unbuilt
from ckpt_tools.dtypes import itemsize
from ckpt_tools.errors import SelectError, UsageError
from ckpt_tools.io.remote.checkpoint import open_path
from ckpt_tools.io.remote.httpurls import shown_url
from ckpt_tools.structure.keys import KeyRule, apply_plan
from ckpt_tools.structure.selection import (
    holds_no_state_dict,
    is_state_dict,
    select_state_dict,
)
from ckpt_tools.structure.suggest import wrapper_stack
from ckpt_tools.structure.wrappers import WRAPPER_RULES, file_wrapper_rules

if TYPE_CHECKING:  # torch and the modules that import it load when a diff reads values
    import torch
    from torch import nn

    from ckpt_tools.diffing.rebuilt import Pieces
    from ckpt_tools.formats import Checkpoint
    from ckpt_tools.io.remote import RemoteSession
    from ckpt_tools.loading.tensor_io import TensorReader

__all__ = ["DiffSide", "Side", "open_side"]

#: What :func:`~ckpt_tools.diffing.engine.diff` compares: a checkpoint path or URL, a state
#: dict, or a module.
DiffSide = Union[str, "os.PathLike[str]", Mapping[str, Any], "nn.Module"]

#: Each side's selection, as ``diff`` and ``ckpt diff`` take it: (argument, flag).
SELECT_ARGUMENTS = {"A": ("select", "--select"), "B": ("select_b", "--select-b")}


class Side:
    """Names -> tensor descriptors or tensors, and a way to stream each one's elements.

    Attributes:
        info: what the report says of this side.
        entries: name -> :class:`~ckpt_tools.descriptors.TensorRef` or
            :class:`~ckpt_tools.descriptors.RebuiltTensor` (a file's) or tensor.
        reader: reads a file's tensors; None where values are not compared, or for tensors.
        others: name -> kind (``str``, ``dict`` ...) of each entry that is not a tensor.
        values: name -> each such entry itself (a file's as its structure reads it).
        foreign: name -> each tensor of a subclass a file records and the reader does not
            rebuild (:class:`~ckpt_tools.diffing.entries.Foreign`); never compared.
        keys: every key of the state dict, in its order, as text.
        not_str: the texts of the keys that are no str (``7``, not ``"7"``).
        metadata: the state dict's ``_metadata`` (its module versions), or None.
        module: the module, for a module side.
    """

    def __init__(
        self,
        info: SideInfo,
        entries: dict[str, Any],
        reader: TensorReader | None,
        others: dict[str, str] | None = None,
        *,
        values: dict[str, Any] | None = None,
        foreign: dict[str, Foreign] | None = None,
        keys: list[Any] | None = None,
        metadata: Any = None,
        module: nn.Module | None = None,
    ):
        self.info = info
        self.entries = entries
        self.reader = reader
        self.others = others or {}
        self.values = values or {}
        self.foreign = foreign or {}
        self.keys = [*entries, *self.foreign, *self.others] if keys is None else [*map(str, keys)]
        self.not_str = frozenset(str(k) for k in keys or () if not isinstance(k, str))
        self.metadata = metadata
        self.module = module

    def rename(self, plan: Mapping[str, str], rules: tuple[KeyRule, ...]) -> None:
        """Rename every key by ``plan`` (made by ``rules``), ``_metadata`` kept in step."""
        self.keys = [plan.get(k, k) for k in self.keys]
        self.entries = {plan.get(k, k): v for k, v in self.entries.items()}
        self.others = {plan.get(k, k): v for k, v in self.others.items()}
        self.values = {plan.get(k, k): v for k, v in self.values.items()}
        self.foreign = {plan.get(k, k): v for k, v in self.foreign.items()}
        if isinstance(self.metadata, Mapping):  # apply_plan renames a mapping's _metadata
            holder: Any = OrderedDict()
            holder._metadata = self.metadata
            self.metadata = apply_plan(holder, {}, rules)._metadata

    def holds_tensor(self, name: str) -> bool:
        """Whether ``name`` is a tensor here, of a kind compared or not."""
        return name in self.entries or name in self.foreign

    def kind(self, name: str) -> str:
        """``tensor``, a foreign tensor's class, or the kind of another entry."""
        if name in self.entries:
            return "tensor"
        return self.foreign[name].kind if name in self.foreign else self.others[name]

    def meta(self, name: str) -> tuple[str, tuple[int, ...] | None]:
        """The dtype and shape of ``name`` (a nested tensor's: components, then -1 each; a
        lazy module's uninitialized parameter's: None)."""
        if name in self.foreign:
            return self.foreign[name].dtype, self.foreign[name].shape
        value = self.entries[name]
        if isinstance(value, (TensorRef, RebuiltTensor)):
            return value.dtype, value.shape
        from ckpt_tools.loading.tensor_io import dtype_name  # a tensor: torch is loaded

        if is_uninitialized(value):  # takes the shape it is loaded with
            return dtype_name(value.dtype), None
        if value.is_nested:  # its components' sizes vary: shaped as a file's is described
            return dtype_name(value.dtype), (value.size(0),) + (-1,) * (value.dim() - 1)
        return dtype_name(value.dtype), tuple(value.shape)

    def layout(self, name: str) -> str:
        """``strided``, a sparse layout's name, ``nested``, or ``meta`` (a meta tensor); a
        foreign tensor's is not known (empty)."""
        if name in self.foreign:
            return ""
        value = self.entries[name]
        if isinstance(value, TensorRef):
            return "strided"
        if isinstance(value, RebuiltTensor):
            return "meta" if value.device == "meta" and value.layout == "strided" else value.layout
        if value.is_nested:
            return "nested"
        layout = str(value.layout).removeprefix("torch.")
        return "meta" if value.is_meta and layout == "strided" else layout

    def stride(self, name: str) -> tuple[int, ...]:
        """A tensor's strides (a meta tensor's only content beside dtype and shape)."""
        value = self.entries[name]
        return tuple(
            value.stride if isinstance(value, (RebuiltTensor, TensorRef)) else value.stride()
        )

    def pieces(self, name: str) -> Pieces | None:
        """A sparse or nested tensor's index parts and values, read to compare them."""
        from ckpt_tools.diffing.rebuilt import file_pieces, tensor_pieces

        value = self.entries[name]
        if isinstance(value, RebuiltTensor):
            assert self.reader is not None
            return file_pieces(self.reader, value, f"{self.info.label}: entry {name!r}")
        return tensor_pieces(value)

    def chunks(self, name: str, elements: int, once: Sequence[int] = ()) -> Iterator[torch.Tensor]:
        """A strided, unquantized tensor's values, ``elements`` at a time, row-major, as
        torch.load gives them (view bits applied); the dims ``once`` (stride 0) at index 0."""
        from ckpt_tools.diffing.value_stats import with_view_bits
        from ckpt_tools.loading.tensor_io import flat_pieces

        value = self.entries[name]
        if isinstance(value, TensorRef):
            assert self.reader is not None
            bits = value.view_bits
            shape = tuple(1 if d in once else n for d, n in enumerate(value.shape))
            once_ref = replace(value, shape=shape)
            for chunk in self.reader.chunks(once_ref, elements * itemsize(value.dtype)):
                yield with_view_bits(chunk, bits)
            return
        for d in once:
            value = value.narrow(d, 0, 1)
        for piece in flat_pieces(value.detach(), elements):
            yield with_view_bits(piece.to("cpu")).contiguous()

    def tensor(self, name: str) -> torch.Tensor:
        """A strided tensor whole, on the CPU: a file's as torch.load gives it (a quantized one
        with its quantizer, view bits applied), an in-memory one as it is."""
        from ckpt_tools.diffing.quantized import QUANTIZED_DTYPES, file_qtensor
        from ckpt_tools.diffing.value_stats import with_view_bits

        value = self.entries[name]
        if not isinstance(value, TensorRef):
            return value.detach().cpu()
        assert self.reader is not None
        if value.dtype in QUANTIZED_DTYPES:
            return file_qtensor(self.reader, value, f"{self.info.label}: entry {name!r}")
        return with_view_bits(self.reader.read(value), value.view_bits)


def _file_side(
    side: str | os.PathLike[str],
    select: Select,
    values: bool,
    session: RemoteSession | None,
    stack: contextlib.ExitStack,
) -> Side:
    """A checkpoint file's (or URL's) side; its tensors are read only to compare values."""
    ckpt = open_path(side, session=session)
    selection = select_state_dict(ckpt.root, select=select)
    label = shown_url(os.fspath(side))  # a URL's password is never shown
    if selection.stand_in:  # its empty stand-in would compare as identical to anything
        raise UsageError(
            f"{holds_no_state_dict(repr(label), ckpt.root)}; diff compares state dicts"
        )
    sd = selection.state_dict
    entries, foreign, others, values_of = split_entries(sd, (TensorRef, RebuiltTensor))
    if not selection.found:
        refuse_unbuilt(label, sd)
        refuse_deeper_tensors(label, sd, entries)
    info = SideInfo(
        label,
        "file",
        path=ckpt.path,
        format=ckpt.format,
        selected=selection.path,
        selection_reason=selection.reason,
        passed_over=selection.passed_over,
        tensors=len(entries),
        skipped=tuple(others),
        unsupported=tuple(foreign),
        unsafe_globals=ckpt.unsafe_globals,
        recovered=selection.module is not None,
    )
    reader = None
    if values:
        from ckpt_tools.loading.tensor_io import TensorReader

        reader = stack.enter_context(TensorReader(ckpt))
    keys = list(sd)
    return Side(
        _with_wrappers(info, [*entries, *foreign], ckpt),
        entries,
        reader,
        others,
        values=values_of,
        foreign=foreign,
        keys=keys,
        metadata=metadata_of(sd),
    )


@contextlib.contextmanager
def _in_memory(side: DiffSide, select: Select, name: str, values: bool) -> Iterator[Side]:
    import torch
    from torch import nn

    module = None
    if isinstance(side, nn.Module):
        if select is not None:
            raise UsageError(
                "applies to checkpoints, not to a module",
                argument=SELECT_ARGUMENTS[name][0],
                value=repr(select),
                flag=SELECT_ARGUMENTS[name][1],
            )
        try:
            module, sd = side, side.state_dict()
        except Exception as e:  # the model's own code (a hook, get_extra_state): named, chained
            failed = f"{type(side).__name__}.state_dict() failed: {type(e).__name__}: {e}"
            raise UsageError(failed) from e
        info = SideInfo(f"<module {type(side).__name__}>", "module")
    elif isinstance(side, Mapping):
        wanted = select is not None or not is_state_dict(side)
        selection = select_state_dict(side, select=select) if wanted else None
        sd = selection.state_dict if selection else side
        info = SideInfo(
            "<state dict>",
            "state_dict",
            selected=selection.path if selection else (),
            selection_reason=selection.reason if selection else "given",
        )
    else:
        raise UsageError(
            f"diff side {name} must be a checkpoint path, a state dict or an nn.Module, got "
            f"{type(side).__name__}"
        )
    entries, foreign, others, values_of = split_entries(sd, torch.Tensor)
    entries = local_tensors(entries, name, values)  # DTensors whole where no collective is needed
    info = replace(info, tensors=len(entries), skipped=tuple(others), unsupported=tuple(foreign))
    yield Side(
        _with_wrappers(info, [*entries, *foreign]),
        entries,
        None,
        others,
        values=values_of,
        foreign=foreign,
        keys=list(sd),
        metadata=metadata_of(sd),
        module=module,
    )


def _with_wrappers(info: SideInfo, keys: Iterable[str], ckpt: Checkpoint | None = None) -> SideInfo:
    """``info`` naming the wrappers at the start of ``keys``: a file's as inspect names them."""
    keys, rules = list(keys), WRAPPER_RULES
    if ckpt is not None:  # (an adapter's base_model.model. is its own, as PEFT loads it)
        rules = file_wrapper_rules(keys, path=ckpt.path, fmt=ckpt.format, metadata=ckpt.metadata)
    return replace(info, wrappers=tuple(m.prefix for m in wrapper_stack(keys, wrappers=rules)))


def open_side(
    side: DiffSide,
    select: Select,
    name: str,
    values: bool,
    session: RemoteSession | None,
    stack: contextlib.ExitStack,
) -> Side:
    """One side of a diff, open until ``stack`` closes.

    Args:
        side: a checkpoint path or URL, a state dict, or a module.
        select: the dotted path to the state dict in a checkpoint (None: chosen as
            ``ckpt inspect`` chooses).
        name: ``A`` or ``B``, for messages.
        values: whether values will be compared (a file's tensors are then readable).
        session: where a URL's reads go; None where neither side is a URL.
        stack: closes what the side holds open (file descriptors).

    Returns:
        The :class:`Side`.

    Raises:
        UsageError: an unsupported type, ``select`` for a module, or values compared of a
            DTensor spread over several ranks (:func:`~ckpt_tools.diffing.entries.local_tensors`).
        SelectError: ``select`` names no entry, named as the side's own argument
            (``select_b``, ``--select-b``).
        CheckpointError: a file cannot be opened.

    Example:
        >>> with contextlib.ExitStack() as stack:
        ...     side = open_side("model.pt", None, "A", False, None, stack)
        >>> side.info.format, side.reader is None
        ('torch-zip', True)
    """
    try:
        if is_file(side):
            return _file_side(side, select, values, session, stack)  # type: ignore[arg-type]
        return stack.enter_context(_in_memory(side, select, name, values))
    except SelectError as e:
        if e.argument != "select":
            raise
        # The selection names its argument `select`, which is A's; B's is `select_b`.
        argument, flag = SELECT_ARGUMENTS[name]
        raise SelectError(
            e.message, path=e.path, argument=argument, value=e.value, flag=flag, remedies=e.remedies
        ) from None
