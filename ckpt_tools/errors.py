"""The error tree. Every error the library raises on purpose is a :class:`CheckpointError`.

Each leaf also subclasses the matching built-in, so ``except ValueError`` in user code
keeps working, and carries the process exit code the CLI uses for it::

    CheckpointError                                   (exit 4 unless a leaf says otherwise)
    ├── UsageError(ValueError)                        2  bad arguments, nothing to select
    │   ├── SelectError(KeyError)                     2  select names no entry
    │   ├── CheckpointNotFoundError(FileNotFoundError) 2
    │   └── MissingExtraError(ImportError)            2  an extra is not installed ([torch])
    ├── UnsafeContentError(pickle.UnpicklingError)    3  globals outside the allowlist
    ├── CorruptCheckpointError(ValueError)            4  truncated, malformed, inconsistent
    │   ├── UnsupportedFormatError                    4  not a checkpoint we can read
    │   └── LfsPointerError                           4  a git-lfs pointer, not the file
    ├── ResourceLimitError(ValueError)                5  input exceeds a safety limit
    ├── OutputError(OSError)                          6  output refused or failed
    │   ├── OutputExistsError(FileExistsError)        6
    │   ├── SameFileError                             6  OUT is IN
    │   └── VerificationError                         6  the written file does not read back
    ├── ConversionError(ValueError)                   7  the conversion is impossible
    │   ├── KeyCollisionError                         7
    │   └── NonTensorEntriesError                     7
    ├── StateDictMismatchError(RuntimeError)          1  load_into(strict=True) found differences
    └── RemoteError(OSError)                          8  a URL could not be read: network, status
        ├── RemoteAccessError(PermissionError)        8  401/403, missing credentials
        └── RangeNotSupportedError                    8  the server ignores byte ranges

Exit codes 0 (ok) and 1 (differences found, ``ckpt diff --fail-on``) are not errors.

An error speaks to whoever reads it. ``str(err)`` names Python arguments
(``pass force=True``); the ``ckpt`` command shows ``err.render(for_cli=True)``, which names
flags (``pass --force``). Both come from the same data on the error: the ``argument`` and
``value`` at fault, the ``path`` it is about, and its :class:`Remedy` list.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from errno import EEXIST, ENOENT
from typing import Any

from ckpt_tools._escape import quote_foreign, shown
from ckpt_tools._remedies import Remedy, assignment, sentence

__all__ = [
    "EXIT_CONVERSION",
    "EXIT_CORRUPT",
    "EXIT_DIFFERENCES",
    "EXIT_OK",
    "EXIT_OUTPUT",
    "EXIT_REMOTE",
    "EXIT_RESOURCE",
    "EXIT_UNSAFE",
    "EXIT_USAGE",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConversionError",
    "CorruptCheckpointError",
    "KeyCollisionError",
    "LfsPointerError",
    "MissingExtraError",
    "NonTensorEntriesError",
    "OutputError",
    "OutputExistsError",
    "RangeNotSupportedError",
    "Remedy",
    "RemoteAccessError",
    "RemoteError",
    "ResourceLimitError",
    "SameFileError",
    "SelectError",
    "StateDictMismatchError",
    "UnsafeContentError",
    "UnsupportedFormatError",
    "UsageError",
    "VerificationError",
    "quote_foreign",
    "shown",
]

EXIT_OK = 0
EXIT_DIFFERENCES = 1
EXIT_USAGE = 2
EXIT_UNSAFE = 3
EXIT_CORRUPT = 4
EXIT_RESOURCE = 5
EXIT_OUTPUT = 6
EXIT_CONVERSION = 7
EXIT_REMOTE = 8


class CheckpointError(Exception):
    """Root of every error ckpt_tools raises on purpose.

    The message says what is wrong; what to do about it is data (``remedies``), rendered in
    Python terms by ``str(err)`` and in command-line terms by ``err.render(for_cli=True)``.

    Args:
        message: what is wrong, without the argument at fault or the fixes.
        path: the file or folder the error is about.
        argument: the Python argument at fault (``"select"``).
        value: its value as Python source (``"'model.ema'"``); when given, the message is
            prefixed with ``argument=value`` (or ``flag value`` on the command line).
        flag: the command-line option for ``argument`` (``"--select"``).
        remedies: the ways to fix it, in the order to suggest them.

    Attributes:
        exit_code: the process exit code the ``ckpt`` command uses for this error.
        message, path, argument, value, flag, remedies: as given.

    Example:
        >>> err = UsageError("no entry 'ema'", argument="select", value="'ema'", flag="--select")
        >>> str(err), err.render(for_cli=True)
        ("select='ema': no entry 'ema'", "--select 'ema': no entry 'ema'")
    """

    exit_code: int = EXIT_CORRUPT

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        argument: str | None = None,
        value: str | None = None,
        flag: str | None = None,
        remedies: Sequence[Remedy] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = None if path is None else os.fspath(path)
        self.argument = argument
        self.value = value
        self.flag = flag
        self.remedies = tuple(remedies)

    @property
    def filename(self) -> str | None:
        """``path``, as OSError's field, which the leaves that are one are read by; a property,
        so that pickling rebuilds them from their own arguments, not OSError's."""
        return self.path

    def render(self, *, for_cli: bool = False) -> str:
        """The error in words: ``argument=value: message; remedies``.

        Args:
            for_cli: name flags (``--force``) instead of Python arguments (``force=True``).

        Returns:
            One line (or the message's own lines) for a person to read.
        """
        text = self.message
        if self.argument is not None and self.value is not None:
            if for_cli and self.flag is not None:
                # A switch is given by its name alone: "--all", not "--all True".
                subject = self.flag if self.value == "True" else f"{self.flag} {self.value}"
            else:
                subject = assignment(self.argument, self.value)
            text = f"{subject}: {text}"
        fixes = sentence(self.remedies, for_cli)
        return f"{text}; {fixes}" if fixes else text

    def __str__(self) -> str:
        # One wording for every built-in parent (KeyError would quote it, OSError add errno).
        return self.render()


class UsageError(CheckpointError, ValueError):
    """An argument is wrong: a bad option value, a missing file, an impossible request."""

    exit_code = EXIT_USAGE


class SelectError(UsageError, KeyError):
    """``select`` names an entry the checkpoint does not have."""


class CheckpointNotFoundError(UsageError, FileNotFoundError):
    """The input path does not exist; ``errno`` is ``ENOENT``, as the built-in's."""

    errno = ENOENT


class MissingExtraError(UsageError, ImportError):
    """A feature needs a package only an extra installs: ``pip install 'ckpt_tools[torch]'``.

    Args:
        feature: what needs it, as the caller knows it (``"load_state_dict"``, ``"ckpt diff"``).
        package: the missing import (``"torch"``), also the error's ``name`` as on any
            ImportError.
        extra: the extra that installs it.

    Example:
        >>> str(MissingExtraError("load_state_dict"))
        "load_state_dict needs torch: pip install 'ckpt_tools[torch]'"
    """

    def __init__(self, feature: str, package: str = "torch", extra: str = "torch") -> None:
        super().__init__(f"{feature} needs {package}: pip install 'ckpt_tools[{extra}]'")
        self.feature, self.package, self.extra = feature, package, extra
        self.name = package  # ImportError's own attribute: the module that could not be imported
        self.args = (feature, package, extra)  # what pickle passes back to __init__


class UnsafeContentError(CheckpointError, pickle.UnpicklingError):
    """The checkpoint refers to Python globals outside the allowlist.

    Attributes:
        globals: the qualified names found, e.g. ``("posix.system",)``.
    """

    exit_code = EXIT_UNSAFE

    def __init__(self, message: str, globals: tuple[str, ...] = (), **context: Any) -> None:
        super().__init__(message, **context)
        self.globals = tuple(globals)


class CorruptCheckpointError(CheckpointError, ValueError):
    """The file is truncated, malformed or internally inconsistent."""

    exit_code = EXIT_CORRUPT


class UnsupportedFormatError(CorruptCheckpointError):
    """The file is not in a format ckpt_tools reads (or not a checkpoint at all)."""


class LfsPointerError(UnsupportedFormatError):
    """The file is a git-lfs pointer: the real file was never downloaded."""


class ResourceLimitError(CheckpointError, ValueError):
    """The input exceeds a safety limit (pickle size, nesting, entry count): a refusal, not a
    ``MemoryError``, so that a handler for running out of memory does not catch it."""

    exit_code = EXIT_RESOURCE


class OutputError(CheckpointError, OSError):
    """Writing the output was refused or failed; the input is untouched.

    ``errno`` is the system error's that made the write fail (``errno.ENOSPC``: a full disk),
    where one did (the error it was raised from); None for a refusal.
    """

    exit_code = EXIT_OUTPUT

    @property  # type: ignore[override]
    def errno(self) -> int | None:
        cause = self.__cause__
        return cause.errno if isinstance(cause, OSError) else None


_OTHER_OUTPUT = Remedy(text="choose another output path")


class OutputExistsError(OutputError, FileExistsError):
    """The output path exists and ``force`` was not given; ``errno`` is ``EEXIST``, as the
    built-in's.

    Args:
        path: the output path; the message and the remedies are built from it.

    Example:
        >>> err = OutputExistsError("out.pt")
        >>> err.render(for_cli=True)
        "output 'out.pt' already exists; pass --force to replace it, or choose another output path"
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(
            f"output {os.fspath(path)!r} already exists",
            path=path,
            remedies=(Remedy("force", "True", flag="--force", text="to replace it"), _OTHER_OUTPUT),
        )
        self.args = (os.fspath(path),)  # what pickle passes back to __init__

    @property  # type: ignore[override]
    def errno(self) -> int:
        return EEXIST


class SameFileError(OutputError):
    """The output is the input (same path, hard link or symlink), or an existing file inside
    an input folder (a shard it reads), and ``in_place`` was not given.

    Args:
        path: the output path; the message and the remedies are built from it.
        offer_in_place: the operation takes ``in_place`` (``--in-place``), so it is offered;
            False where it has no such option (``slim``, ``sanitize``): another output path
            is the only fix said.
        folder: the input folder ``path`` lies in, when the input is a folder.

    Example:
        >>> SameFileError("in.pt", offer_in_place=False).render(for_cli=True).split("; ")[1]
        'choose another output path'
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        offer_in_place: bool = True,
        folder: str | os.PathLike[str] | None = None,
    ) -> None:
        rewrite = Remedy(
            "in_place",
            "True",
            flag="--in-place",
            text="to rewrite it (still through a temp file and a rename)",
        )
        what = (
            "the input file (same path, hard link or symlink)"
            if folder is None
            else f"a file of the input folder {os.fspath(folder)!r}"
        )
        super().__init__(
            f"output {os.fspath(path)!r} is {what}",
            path=path,
            remedies=(rewrite, _OTHER_OUTPUT) if offer_in_place else (_OTHER_OUTPUT,),
        )
        self.args = (os.fspath(path), offer_in_place)  # what pickle passes back to __init__


class VerificationError(OutputError):
    """The written output does not read back as what was meant to be written.

    Raised before the temp file is renamed, so the message says the output was not kept.

    Example:
        >>> str(VerificationError("'w' reads back as float16"))
        "'w' reads back as float16; the output was not kept"
    """

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(f"{message}; the output was not kept", **context)
        self.args = (message,)


class ConversionError(CheckpointError, ValueError):
    """The requested conversion cannot be done faithfully."""

    exit_code = EXIT_CONVERSION


class KeyCollisionError(ConversionError):
    """A key rewrite would map two keys onto one.

    Attributes:
        collisions: ``(new_key, (old_key, ...))`` pairs.
    """

    def __init__(
        self,
        message: str,
        collisions: tuple[tuple[str, tuple[str, ...]], ...] = (),
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
        self.collisions = tuple(collisions)


class NonTensorEntriesError(ConversionError):
    """The target format holds tensors only, and the source has other entries.

    Attributes:
        entries: the names of the non-tensor entries.
    """

    def __init__(self, message: str, entries: tuple[str, ...] = (), **context: Any) -> None:
        super().__init__(message, **context)
        self.entries = tuple(entries)


class StateDictMismatchError(CheckpointError, RuntimeError):
    """``load_into(strict=True)`` found keys or shapes that do not match the model."""

    exit_code = EXIT_DIFFERENCES


class RemoteError(CheckpointError, OSError):
    """A remote file (``https://``, ``hf://``, ``s3://``) could not be read: a refused or
    timed-out connection, an unexpected status, an answer that is not what was asked."""

    exit_code = EXIT_REMOTE


class RemoteAccessError(RemoteError, PermissionError):
    """The server refused the credentials sent, or none were sent (401, 403): the message
    names the setting that supplies them (``HF_TOKEN``, the AWS credentials)."""


class RangeNotSupportedError(RemoteError):
    """The server answered a byte range with the whole file: refused before its body is read,
    so a metadata read never turns into a download."""
