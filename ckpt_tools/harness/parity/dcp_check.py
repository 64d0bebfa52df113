"""(f) ``dcp_roundtrip``: a DCP folder, consolidated, loads into the bare model as the gathered
reference, bitwise. (g) ``zero_roundtrip``: a DeepSpeed ZeRO folder, consolidated, loads into
the bare model and equals DeepSpeed's own ``zero_to_fp32`` state dict, bitwise.

The converter is a parameter: by default ``ckpt consolidate``'s library call
(:func:`ckpt_consolidate`, torch-free, bounded memory); torch's own
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (:func:`torch_dcp_to_pt`)
plugs in the same way, as any callable ``(dcp_dir, out_file) -> anything`` that writes a
``torch.load``-able file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpt_tools.harness.parity.checks import (
    CheckResult,
    _attempt,
    _fresh,
    _load_strict,
    _result,
)
from ckpt_tools.harness.parity.reference import compare_state_dicts, load_pt

__all__ = [
    "Converter",
    "check_dcp_roundtrip",
    "check_zero_roundtrip",
    "ckpt_consolidate",
    "torch_dcp_to_pt",
]

#: ``(dcp_dir, out_file)``: writes ``out_file`` from the DCP folder.
Converter = Callable[[Path, Path], Any]


def ckpt_consolidate(dcp_dir: Path, out_file: Path) -> None:
    """Ours: :func:`ckpt_tools.consolidate` of the model state dict (``ckpt consolidate``).

    Args:
        dcp_dir: the DCP checkpoint folder, or a DeepSpeed ZeRO save folder.
        out_file: the ``.pt`` file to write.
    """
    from ckpt_tools.ops.consolidate.consolidation import consolidate

    consolidate(dcp_dir, out_file)


def torch_dcp_to_pt(dcp_dir: Path, out_file: Path) -> None:
    """torch's converter: ``dcp_to_torch_save`` (loads everything into memory, no process group).

    Args:
        dcp_dir: the DCP checkpoint folder.
        out_file: the ``torch.save`` file to write.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, out_file)


def check_dcp_roundtrip(
    dcp_dir: str | Path,
    reference: str | Path,
    converter: Converter = ckpt_consolidate,
    *,
    model: str = "mlp",
    model_kwargs: Mapping[str, Any] | None = None,
    work_dir: str | Path | None = None,
    strategy: str = "fsdp",
) -> CheckResult:
    """(f) DCP folder -> ``converter`` -> strict load into the bare model == reference, bitwise.

    Args:
        dcp_dir: the folder ``torch.distributed.checkpoint.save`` wrote; the model's state
            dict is under ``"model"`` in it.
        reference: the full state dict gathered on rank 0 (``bare.pt``).
        converter: writes a single ``torch.save`` file from ``dcp_dir``.
        model: the harness model the run trained.
        model_kwargs: its extra arguments.
        work_dir: where the consolidated file goes (default: beside ``dcp_dir``).
        strategy: label for the result.

    Returns:
        Passed when the converted model state dict loads with ``strict=True`` and the
        model's state dict then equals the reference in keys, dtypes, shapes and bytes; a
        :data:`~ckpt_tools.harness.parity.checks.FINDINGS` error is a failed result naming it.

    Example:
        >>> check_dcp_roundtrip("out/fsdp/dcp", "out/fsdp/bare.pt").passed  # doctest: +SKIP
        True

        Any converter plugs in; this one just copies a state dict (the ``mlp`` fixtures
        have one hidden layer of 4):

        >>> import shutil
        >>> copy = lambda dcp_dir, out: shutil.copy("out/single/bare.pt", out)
        >>> row = check_dcp_roundtrip("out/single", "out/single/bare.pt", copy,
        ...                           model_kwargs={"hidden": (4,)}, work_dir="work")
        >>> row.passed, row.max_abs_diff
        (True, 0.0)
    """
    name = "dcp_roundtrip"
    kw = dict(model_kwargs or {})
    bare = _fresh(model, kw, _cpu())  # an unknown model is the caller's UsageError

    def body() -> CheckResult:
        converted, what = _convert(converter, Path(dcp_dir), work_dir)
        state_dict = converted.get("model", converted)
        _load_strict(bare, state_dict)
        loaded = {k: v.detach() for k, v in bare.state_dict().items()}
        gap, problems = compare_state_dicts(load_pt(reference), loaded)
        detail = f"DCP -> {what} -> strict load into the bare model " + (
            f": {'; '.join(problems[:3])}" if problems else "bitwise equal to the gathered state"
        )
        return _result(name, strategy, gap, 0.0, not problems, detail)

    return _attempt(name, strategy, 0.0, body)


def check_zero_roundtrip(
    deepspeed_dir: str | Path,
    reference: str | Path,
    converter: Converter = ckpt_consolidate,
    *,
    model: str = "mlp",
    model_kwargs: Mapping[str, Any] | None = None,
    work_dir: str | Path | None = None,
    strategy: str = "zero",
) -> CheckResult:
    """(g) DeepSpeed folder -> ``converter`` == ``zero_to_fp32``'s state dict, bitwise, and
    loads strictly into the bare model.

    Args:
        deepspeed_dir: the save folder ``engine.save_checkpoint`` wrote (``latest`` names
            the tag).
        reference: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` of that folder,
            as ``torch.save`` wrote it (``zero_to_fp32.pt``).
        converter: writes a single ``torch.save`` file from ``deepspeed_dir``.
        model: the harness model the run trained.
        model_kwargs: its extra arguments.
        work_dir: where the consolidated file goes (default: beside ``deepspeed_dir``).
        strategy: label for the result.

    Returns:
        Passed when the converted state dict equals the reference in keys, dtypes, shapes
        and bytes and loads into the model with ``strict=True``; a
        :data:`~ckpt_tools.harness.parity.checks.FINDINGS` error is a failed result naming it.

    Example:
        >>> check_zero_roundtrip("out/zero/deepspeed", "out/zero/zero_to_fp32.pt").passed
        ... # doctest: +SKIP
        True

        Any converter plugs in; this one copies a state dict in place of consolidating:

        >>> import shutil
        >>> copy = lambda folder, out: shutil.copy("out/single/bare.pt", out)
        >>> row = check_zero_roundtrip("out/single", "out/single/bare.pt", copy,
        ...                            model_kwargs={"hidden": (4,)}, work_dir="work")
        >>> row.passed
        True
    """
    name = "zero_roundtrip"
    bare = _fresh(model, dict(model_kwargs or {}), _cpu())  # an unknown model is the caller's

    def body() -> CheckResult:
        converted, what = _convert(converter, Path(deepspeed_dir), work_dir)
        _load_strict(bare, converted)
        gap, problems = compare_state_dicts(load_pt(reference), converted)
        detail = f"DeepSpeed folder -> {what}, strict load into the bare model, " + (
            f"vs zero_to_fp32: {'; '.join(problems[:3])}"
            if problems
            else "bitwise equal to zero_to_fp32"
        )
        return _result(name, strategy, gap, 0.0, not problems, detail)

    return _attempt(name, strategy, 0.0, body)


def _convert(converter: Converter, source: Path, work_dir: str | Path | None) -> tuple[Any, str]:
    """Run ``converter`` from ``source`` into a fresh file in ``work_dir`` (default: beside
    ``source``); what it wrote, loaded, and the converter's name for the result's detail."""
    work = Path(work_dir) if work_dir is not None else source.parent
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{source.name}.consolidated.pt"
    out.unlink(missing_ok=True)  # a re-run must not read its own old output
    converter(source, out)
    return load_pt(out), getattr(converter, "__name__", type(converter).__name__)


def _cpu() -> Any:
    import torch

    return torch.device("cpu")
