"""ckpt_tools: inspect, rewrite, convert, diff and load PyTorch checkpoints, on any device.

The public API lives here. Importing it never imports torch: functions that need torch
(loading, value diffs, the harness) import it when called.
"""

from __future__ import annotations

from typing import Any

from ckpt_tools._version import __version__
from ckpt_tools.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConversionError,
    CorruptCheckpointError,
    KeyCollisionError,
    LfsPointerError,
    NonTensorEntriesError,
    OutputError,
    OutputExistsError,
    ResourceLimitError,
    SameFileError,
    SelectError,
    StateDictMismatchError,
    UnsafeContentError,
    UnsupportedFormatError,
    UsageError,
    VerificationError,
)
from ckpt_tools.formats import Checkpoint, detect_format, open_checkpoint
from ckpt_tools.structure.keys import (
    WRAPPER_RULES,
    KeyRule,
    WrapperMatch,
    add_prefix,
    detect_wrappers,
    regex_rule,
    rename_keys,
    strip_prefix,
    sub_rule,
)
from ckpt_tools.structure.selection import Selection, select_state_dict

__all__ = [
    "WRAPPER_RULES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConversionError",
    "CorruptCheckpointError",
    "KeyCollisionError",
    "KeyRule",
    "LfsPointerError",
    "NonTensorEntriesError",
    "OutputError",
    "OutputExistsError",
    "ResourceLimitError",
    "SameFileError",
    "SelectError",
    "Selection",
    "StateDictMismatchError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UsageError",
    "VerificationError",
    "WrapperMatch",
    "__version__",
    "add_prefix",
    "detect_format",
    "detect_wrappers",
    "open_checkpoint",
    "regex_rule",
    "rename_keys",
    "select_state_dict",
    "strip_prefix",
    "sub_rule",
]

# Functions whose modules import torch (or write files) load on first use. The result
# classes come from their torch-free modules: naming one never imports torch.
_LAZY = {
    "inspect": "ckpt_tools.ops.inspection",
    "CheckpointInfo": "ckpt_tools.ops.inspection_info",
    "TensorInfo": "ckpt_tools.ops.inspection_info",
    "rewrite": "ckpt_tools.ops.rewriting",
    "convert": "ckpt_tools.ops.rewriting",
    "retag": "ckpt_tools.ops.rewriting",
    "strip_module_file": "ckpt_tools.ops.rewriting",
    "RewriteResult": "ckpt_tools.ops.rewrite_result",
    "reshard": "ckpt_tools.ops.reshard",
    "ShardsResult": "ckpt_tools.ops.reshard",
    "sanitize": "ckpt_tools.ops.sanitize",
    "SanitizeReport": "ckpt_tools.ops.sanitize_result",
    "consolidate": "ckpt_tools.ops.consolidate",
    "ConsolidateResult": "ckpt_tools.ops.consolidate",
    "slim": "ckpt_tools.ops.slim",
    "extract": "ckpt_tools.ops.extract",
    "average": "ckpt_tools.ops.average",
    "TransformResult": "ckpt_tools.ops.transform_result",
    "PlannedFile": "ckpt_tools.ops.output_plan",
    "PlannedTensor": "ckpt_tools.ops.output_plan",
    "load_state_dict": "ckpt_tools.loading.state_dict",
    "load_into": "ckpt_tools.loading.into_module",
    "LoadReport": "ckpt_tools.loading.results",
    "LoadInfo": "ckpt_tools.loading.results",
    "diff": "ckpt_tools.diffing.engine",
    "DiffReport": "ckpt_tools.diffing.report",
}
__all__ += sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckpt_tools' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazily loaded names too, so `ct.inspect` and `ct.load_into` tab-complete.
    return sorted({*globals(), *_LAZY})
