"""Building a model from ``MODULE:FACTORY`` or ``path/to/file.py:FACTORY`` (``ckpt diff --model``).

This imports and runs the code the user names, on purpose: only ever call it with a spec
the user typed.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ckpt_tools.errors import Remedy, UsageError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["module_from_spec", "parse_value"]


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, else the text.

    Example:
        >>> [parse_value(v) for v in ("3", "1e-3", "False", "relu")]
        [3, 0.001, False, 'relu']
    """
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _spec_error(message: str, spec: str, remedies: tuple[Remedy, ...] = ()) -> UsageError:
    """A :class:`UsageError` about the ``--model`` spec the user typed."""
    return UsageError(message, argument="spec", value=repr(spec), flag="--model", remedies=remedies)


def _load_file(path: str, spec: str) -> ModuleType:
    if not os.path.isfile(path):
        raise _spec_error(f"no such file {path!r}", spec)
    name = "ckpt_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise _spec_error(f"{path!r} cannot be imported as a Python file", spec)
    module = importlib.util.module_from_spec(module_spec)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file can import its neighbours
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    # SystemExit too: the file's sys.exit(3) would end ckpt with a code of ours (exit 3).
    except (Exception, SystemExit) as e:  # the user's file failed to import: say so
        del sys.modules[name]
        raise _spec_error(f"importing {path!r} failed: {_failure(e)}", spec) from e
    return module


def _failure(e: BaseException) -> str:
    """A user's error in words; a ``SystemExit`` as the call that raised it."""
    if isinstance(e, SystemExit):
        return "it called sys.exit()" if e.code is None else f"it called sys.exit({e.code!r})"
    return f"{type(e).__name__}: {e}"


def _import(where: str, spec: str) -> ModuleType:
    """The module part of a spec: a file when it looks like a path, else an import."""
    if where.endswith(".py") or os.sep in where or "/" in where:
        return _load_file(where, spec)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is not None and (where == e.name or where.startswith(f"{e.name}.")):
            raise _spec_error(
                f"cannot import {where!r} ({e}); give a file instead: path/to/file.py:FACTORY",
                spec,
            ) from e
        raise _spec_error(f"importing {where!r} failed: {_failure(e)}", spec) from e
    # As for a file: the module's own error (or its sys.exit, whose code would read as ours).
    except (Exception, SystemExit) as e:
        raise _spec_error(f"importing {where!r} failed: {_failure(e)}", spec) from e


def _factory(module: ModuleType, where: str, attribute: str, spec: str) -> Any:
    """The callable a spec's (possibly dotted) attribute names in ``module``."""
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            names = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            )
            raise _spec_error(
                f"{where!r} has no {attribute!r}; callables there: "
                f"{', '.join(names[:15]) or 'none'}",
                spec,
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise _spec_error(
            f"{attribute!r} ({type(factory).__name__}) is not a class or function returning an "
            "nn.Module",
            spec,
        )
    return factory


def _check_arguments(factory: Any, attribute: str, arguments: dict[str, Any], spec: str) -> None:
    """Refuse arguments the factory's signature does not take, before calling it."""
    try:
        signature = inspect.signature(factory)
    except ValueError:
        return  # no signature to check (some builtins): let the call decide
    try:
        signature.bind(**arguments)
    except TypeError as e:
        remedy = Remedy(
            "kwargs",
            "{'KEY': VALUE}",
            flag="--model-arg KEY=VALUE",
            text="with the arguments it takes",
        )
        raise _spec_error(
            f"{attribute}{signature} does not take {arguments}: {e}", spec, (remedy,)
        ) from e


def module_from_spec(spec: str, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """Import ``spec`` and call it with ``kwargs`` to get an ``nn.Module``.

    Args:
        spec: ``package.module:Factory`` (importable) or ``path/to/file.py:Factory``;
            ``Factory`` may be dotted (``models:Zoo.small``) and is a class or a function.
        kwargs: keyword arguments for the factory.

    Returns:
        The model.

    Raises:
        UsageError: malformed spec, missing module, file or attribute, arguments the
            factory does not take, a file or factory that raises (its error named), or a
            result that is not an ``nn.Module``.

    Example:
        >>> module_from_spec("torch.nn:Linear", {"in_features": 2, "out_features": 3})
        Linear(in_features=2, out_features=3, bias=True)
    """
    from torch import nn

    where, sep, attribute = spec.rpartition(":")
    if not sep or not where or not attribute:
        raise _spec_error(
            "expected MODULE:FACTORY or path/to/file.py:FACTORY, e.g. "
            "'torchvision.models:resnet18' or 'net.py:Net'",
            spec,
        )
    factory = _factory(_import(where, spec), where, attribute, spec)
    arguments = dict(kwargs or {})
    _check_arguments(factory, attribute, arguments, spec)
    try:
        model = factory(**arguments)
    except (Exception, SystemExit) as e:  # the user's factory failed (a bad --model-arg)
        raise _spec_error(f"{attribute}(**{arguments}) failed: {_failure(e)}", spec) from e
    if not isinstance(model, nn.Module):
        raise _spec_error(
            f"returned a {type(model).__name__}, not an nn.Module; point it at a model class or "
            "a function returning a model",
            spec,
        )
    return model
