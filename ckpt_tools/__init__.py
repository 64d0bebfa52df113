"""ckpt_tools: inspect, rewrite, convert, diff and load PyTorch checkpoints, on any device.

The public API lives here. Importing it imports nothing else: each name loads its module on
first use, so ``import ckpt_tools`` and ``ckpt --version`` cost microseconds, and functions that
need torch (loading, value diffs, the harness) import it only when called.
"""

from __future__ import annotations

from ckpt_tools._version import __version__

# Not `from typing import TYPE_CHECKING`: typing (with re, enum and collections, which a
# regular install has not loaded yet) would be most of `ckpt --version`'s own time. Type
# checkers read this name as typing's.
TYPE_CHECKING = False
if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each loads on first use
    from typing import Any

    from ckpt_tools._types import (
        MapLocation,
        OutputFormat,
        Progress,
        Select,
        StrPath,
        VerifyLevel,
    )
    from ckpt_tools.diffing.engine import diff
    from ckpt_tools.diffing.report import DiffReport
    from ckpt_tools.errors import (
        CheckpointError,
        CheckpointNotFoundError,
        ConversionError,
        CorruptCheckpointError,
        KeyCollisionError,
        LfsPointerError,
        MissingExtraError,
        NonTensorEntriesError,
        OutputError,
        OutputExistsError,
        RangeNotSupportedError,
        RemoteAccessError,
        RemoteError,
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
    from ckpt_tools.loading.devices import DeviceInfo, list_devices, pick_devices
    from ckpt_tools.loading.into_module import load_into
    from ckpt_tools.loading.results import LoadInfo, LoadReport
    from ckpt_tools.loading.state_dict import load_state_dict, load_with_info
    from ckpt_tools.ops.average.averaging import average
    from ckpt_tools.ops.consolidate.consolidation import ConsolidateResult, consolidate
    from ckpt_tools.ops.inspect.info import CheckpointInfo, TensorInfo
    from ckpt_tools.ops.inspect.inspection import inspect
    from ckpt_tools.ops.merge.merging import merge_lora
    from ckpt_tools.ops.merge.result import MergeResult
    from ckpt_tools.ops.output_plan import PlannedFile, PlannedTensor, WriteResult
    from ckpt_tools.ops.rewrite.conversion import convert, retag
    from ckpt_tools.ops.rewrite.result import RewriteResult
    from ckpt_tools.ops.rewrite.rewriting import add_module, rename, rewrite, strip_module
    from ckpt_tools.ops.sanitize.result import SanitizeResult
    from ckpt_tools.ops.sanitize.sanitizing import sanitize
    from ckpt_tools.ops.scan import FileScan, Finding, ScanReport, scan
    from ckpt_tools.ops.transform.extract import extract
    from ckpt_tools.ops.transform.reshard import reshard
    from ckpt_tools.ops.transform.result import TransformResult
    from ckpt_tools.ops.transform.slim import slim
    from ckpt_tools.structure.keys import KeyRule, regex_rule, rename_keys, sub_rule
    from ckpt_tools.structure.selection import Selection, select_state_dict
    from ckpt_tools.structure.wrappers import (
        WRAPPER_RULES,
        WrapperMatch,
        add_prefix,
        detect_wrappers,
        strip_prefix,
    )

# name: the module that defines it. Naming a result class never imports torch: they live in
# torch-free modules.
_PUBLIC: dict[str, str] = {
    "CheckpointError": "ckpt_tools.errors",
    "CheckpointNotFoundError": "ckpt_tools.errors",
    "ConversionError": "ckpt_tools.errors",
    "CorruptCheckpointError": "ckpt_tools.errors",
    "KeyCollisionError": "ckpt_tools.errors",
    "LfsPointerError": "ckpt_tools.errors",
    "MissingExtraError": "ckpt_tools.errors",
    "NonTensorEntriesError": "ckpt_tools.errors",
    "OutputError": "ckpt_tools.errors",
    "OutputExistsError": "ckpt_tools.errors",
    "RangeNotSupportedError": "ckpt_tools.errors",
    "RemoteAccessError": "ckpt_tools.errors",
    "RemoteError": "ckpt_tools.errors",
    "ResourceLimitError": "ckpt_tools.errors",
    "SameFileError": "ckpt_tools.errors",
    "SelectError": "ckpt_tools.errors",
    "StateDictMismatchError": "ckpt_tools.errors",
    "UnsafeContentError": "ckpt_tools.errors",
    "UnsupportedFormatError": "ckpt_tools.errors",
    "UsageError": "ckpt_tools.errors",
    "VerificationError": "ckpt_tools.errors",
    "Checkpoint": "ckpt_tools.formats",
    "detect_format": "ckpt_tools.formats",
    "open_checkpoint": "ckpt_tools.formats",
    "WRAPPER_RULES": "ckpt_tools.structure.wrappers",
    "KeyRule": "ckpt_tools.structure.keys",
    "WrapperMatch": "ckpt_tools.structure.wrappers",
    "add_prefix": "ckpt_tools.structure.wrappers",
    "detect_wrappers": "ckpt_tools.structure.wrappers",
    "regex_rule": "ckpt_tools.structure.keys",
    "rename_keys": "ckpt_tools.structure.keys",
    "strip_prefix": "ckpt_tools.structure.wrappers",
    "sub_rule": "ckpt_tools.structure.keys",
    "Selection": "ckpt_tools.structure.selection",
    "select_state_dict": "ckpt_tools.structure.selection",
    "inspect": "ckpt_tools.ops.inspect.inspection",
    "CheckpointInfo": "ckpt_tools.ops.inspect.info",
    "TensorInfo": "ckpt_tools.ops.inspect.info",
    "rewrite": "ckpt_tools.ops.rewrite.rewriting",
    "strip_module": "ckpt_tools.ops.rewrite.rewriting",
    "add_module": "ckpt_tools.ops.rewrite.rewriting",
    "rename": "ckpt_tools.ops.rewrite.rewriting",
    "convert": "ckpt_tools.ops.rewrite.conversion",
    "retag": "ckpt_tools.ops.rewrite.conversion",
    "RewriteResult": "ckpt_tools.ops.rewrite.result",
    "reshard": "ckpt_tools.ops.transform.reshard",
    "sanitize": "ckpt_tools.ops.sanitize.sanitizing",
    "SanitizeResult": "ckpt_tools.ops.sanitize.result",
    "scan": "ckpt_tools.ops.scan",
    "ScanReport": "ckpt_tools.ops.scan",
    "FileScan": "ckpt_tools.ops.scan",
    "Finding": "ckpt_tools.ops.scan",
    "consolidate": "ckpt_tools.ops.consolidate.consolidation",
    "ConsolidateResult": "ckpt_tools.ops.consolidate.consolidation",
    "slim": "ckpt_tools.ops.transform.slim",
    "extract": "ckpt_tools.ops.transform.extract",
    "average": "ckpt_tools.ops.average.averaging",
    "TransformResult": "ckpt_tools.ops.transform.result",
    "merge_lora": "ckpt_tools.ops.merge.merging",
    "MergeResult": "ckpt_tools.ops.merge.result",
    "PlannedFile": "ckpt_tools.ops.output_plan",
    "PlannedTensor": "ckpt_tools.ops.output_plan",
    "WriteResult": "ckpt_tools.ops.output_plan",
    "MapLocation": "ckpt_tools._types",
    "OutputFormat": "ckpt_tools._types",
    "Progress": "ckpt_tools._types",
    "Select": "ckpt_tools._types",
    "StrPath": "ckpt_tools._types",
    "VerifyLevel": "ckpt_tools._types",
    "load_state_dict": "ckpt_tools.loading.state_dict",
    "load_with_info": "ckpt_tools.loading.state_dict",
    "load_into": "ckpt_tools.loading.into_module",
    "LoadReport": "ckpt_tools.loading.results",
    "LoadInfo": "ckpt_tools.loading.results",
    "DeviceInfo": "ckpt_tools.loading.devices",
    "list_devices": "ckpt_tools.loading.devices",
    "pick_devices": "ckpt_tools.loading.devices",
    "diff": "ckpt_tools.diffing.engine",
    "DiffReport": "ckpt_tools.diffing.report",
}

# Every name _PUBLIC maps, and __version__ (tests/test_architecture.py checks they agree).
__all__ = [
    "WRAPPER_RULES",
    "Checkpoint",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "ConsolidateResult",
    "ConversionError",
    "CorruptCheckpointError",
    "DeviceInfo",
    "DiffReport",
    "FileScan",
    "Finding",
    "KeyCollisionError",
    "KeyRule",
    "LfsPointerError",
    "LoadInfo",
    "LoadReport",
    "MapLocation",
    "MergeResult",
    "MissingExtraError",
    "NonTensorEntriesError",
    "OutputError",
    "OutputExistsError",
    "OutputFormat",
    "PlannedFile",
    "PlannedTensor",
    "Progress",
    "RangeNotSupportedError",
    "RemoteAccessError",
    "RemoteError",
    "ResourceLimitError",
    "RewriteResult",
    "SameFileError",
    "SanitizeResult",
    "ScanReport",
    "Select",
    "SelectError",
    "Selection",
    "StateDictMismatchError",
    "StrPath",
    "TensorInfo",
    "TransformResult",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UsageError",
    "VerificationError",
    "VerifyLevel",
    "WrapperMatch",
    "WriteResult",
    "__version__",
    "add_module",
    "add_prefix",
    "average",
    "consolidate",
    "convert",
    "detect_format",
    "detect_wrappers",
    "diff",
    "extract",
    "inspect",
    "list_devices",
    "load_into",
    "load_state_dict",
    "load_with_info",
    "merge_lora",
    "open_checkpoint",
    "pick_devices",
    "regex_rule",
    "rename",
    "rename_keys",
    "reshard",
    "retag",
    "rewrite",
    "sanitize",
    "scan",
    "select_state_dict",
    "slim",
    "strip_module",
    "strip_prefix",
    "sub_rule",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_tools' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # The lazily loaded names too, so `ct.inspect` and `ct.load_into` tab-complete.
    return sorted({*globals(), *_PUBLIC})
