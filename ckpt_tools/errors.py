"""The error tree. Every error the library raises on purpose is a :class:`CheckpointError`.

Each leaf also subclasses the matching built-in, so ``except ValueError`` in user code
keeps working, and carries the process exit code the CLI uses for it::

    CheckpointError                                   (exit 4 unless a leaf says otherwise)
    ├── UsageError(ValueError)                        2  bad arguments, nothing to select
    │   ├── SelectError(KeyError)                     2  --select names no entry
    │   └── CheckpointNotFoundError(FileNotFoundError) 2
    ├── UnsafeContentError(pickle.UnpicklingError)    3  globals outside the allowlist
    ├── CorruptCheckpointError(ValueError)            4  truncated, malformed, inconsistent
    │   ├── UnsupportedFormatError                    4  not a checkpoint we can read
    │   └── LfsPointerError                           4  a git-lfs pointer, not the file
    ├── ResourceLimitError(MemoryError)               5  input exceeds a safety limit
    ├── OutputError(OSError)                          6  output refused or failed
    │   ├── OutputExistsError(FileExistsError)        6
    │   ├── SameFileError                             6  OUT is IN
    │   └── VerificationError                         6  the written file does not read back
    ├── ConversionError(ValueError)                   7  the conversion is impossible
    │   ├── KeyCollisionError                         7
    │   └── NonTensorEntriesError                     7
    └── StateDictMismatchError(RuntimeError)          1  load_into(strict=True) found differences

Exit codes 0 (ok) and 1 (differences found, ``ckpt diff --fail-on``) are not errors.
"""

from __future__ import annotations

import pickle

__all__ = [
    "EXIT_CONVERSION",
    "EXIT_CORRUPT",
    "EXIT_DIFFERENCES",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_RESOURCE",
    "EXIT_UNSAFE",
    "EXIT_USAGE",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConversionError",
    "CorruptCheckpointError",
    "KeyCollisionError",
    "LfsPointerError",
    "NonTensorEntriesError",
    "OutputError",
    "OutputExistsError",
    "ResourceLimitError",
    "SameFileError",
    "SelectError",
    "StateDictMismatchError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UsageError",
    "VerificationError",
]

EXIT_OK = 0
EXIT_DIFFERENCES = 1
EXIT_USAGE = 2
EXIT_UNSAFE = 3
EXIT_CORRUPT = 4
EXIT_RESOURCE = 5
EXIT_OUTPUT = 6
EXIT_CONVERSION = 7


class CheckpointError(Exception):
    """Root of every error ckpt_tools raises on purpose.

    Attributes:
        exit_code: the process exit code the ``ckpt`` command uses for this error.
    """

    exit_code: int = EXIT_CORRUPT


class UsageError(CheckpointError, ValueError):
    """An argument is wrong: a bad option value, a missing file, an impossible request."""

    exit_code = EXIT_USAGE


class SelectError(UsageError, KeyError):
    """``select`` names an entry the checkpoint does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CheckpointNotFoundError(UsageError, FileNotFoundError):
    """The input path does not exist."""


class UnsafeContentError(CheckpointError, pickle.UnpicklingError):
    """The checkpoint refers to Python globals outside the allowlist.

    Attributes:
        globals: the qualified names found, e.g. ``("posix.system",)``.
    """

    exit_code = EXIT_UNSAFE

    def __init__(self, message: str, globals: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.globals = globals


class CorruptCheckpointError(CheckpointError, ValueError):
    """The file is truncated, malformed or internally inconsistent."""

    exit_code = EXIT_CORRUPT


class UnsupportedFormatError(CorruptCheckpointError):
    """The file is not in a format ckpt_tools reads (or not a checkpoint at all)."""


class LfsPointerError(UnsupportedFormatError):
    """The file is a git-lfs pointer: the real file was never downloaded."""


class ResourceLimitError(CheckpointError, MemoryError):
    """The input exceeds a safety limit (pickle size, nesting, entry count)."""

    exit_code = EXIT_RESOURCE


class OutputError(CheckpointError, OSError):
    """Writing the output was refused or failed; the input is untouched."""

    exit_code = EXIT_OUTPUT


class OutputExistsError(OutputError, FileExistsError):
    """The output path exists and ``force`` was not given."""


class SameFileError(OutputError):
    """The output is the input (same path, hard link or symlink) and ``in_place`` was not given."""


class VerificationError(OutputError):
    """The written output does not read back as what was meant to be written."""


class ConversionError(CheckpointError, ValueError):
    """The requested conversion cannot be done faithfully."""

    exit_code = EXIT_CONVERSION


class KeyCollisionError(ConversionError):
    """A key rewrite would map two keys onto one.

    Attributes:
        collisions: ``(new_key, (old_key, ...))`` pairs.
    """

    def __init__(self, message: str, collisions: tuple[tuple[str, tuple[str, ...]], ...] = ()):
        super().__init__(message)
        self.collisions = collisions


class NonTensorEntriesError(ConversionError):
    """The target format holds tensors only, and the source has other entries.

    Attributes:
        entries: the names of the non-tensor entries.
    """

    def __init__(self, message: str, entries: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.entries = entries


class StateDictMismatchError(CheckpointError, RuntimeError):
    """``load_into(strict=True)`` found keys or shapes that do not match the model."""

    exit_code = EXIT_DIFFERENCES
