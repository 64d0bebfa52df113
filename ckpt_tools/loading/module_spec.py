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

__all__ = ["build_model", "parse_value"]


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


def _load_file(path: str, spec: str) -> ModuleType:
    if not os.path.isfile(path):
        raise UsageError(
            f"no such file {path!r}", argument="spec", value=repr(spec), flag="--model"
        )
    name = "ckpt_model_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(
            f"{path!r} cannot be imported as a Python file",
            argument="spec",
            value=repr(spec),
            flag="--model",
        )
    module = importlib.util.module_from_spec(module_spec)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file can import its neighbours
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    return module


def build_model(spec: str, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """Import ``spec`` and call it with ``kwargs`` to get an ``nn.Module``.

    Args:
        spec: ``package.module:Factory`` (importable) or ``path/to/file.py:Factory``;
            ``Factory`` may be dotted (``models:Zoo.small``) and is a class or a function.
        kwargs: keyword arguments for the factory.

    Returns:
        The model.

    Raises:
        UsageError: malformed spec, missing module, file or attribute, arguments the
            factory does not take, or a result that is not an ``nn.Module``.

    Example:
        >>> build_model("torch.nn:Linear", {"in_features": 2, "out_features": 3})
        Linear(in_features=2, out_features=3, bias=True)
    """
    from torch import nn

    where, sep, attribute = spec.rpartition(":")
    if not sep or not where or not attribute:
        raise UsageError(
            "expected MODULE:FACTORY or path/to/file.py:FACTORY, e.g. "
            "'torchvision.models:resnet18' or 'net.py:Net'",
            argument="spec",
            value=repr(spec),
            flag="--model",
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UsageError(
                f"cannot import {where!r} ({e}); give a file instead: path/to/file.py:FACTORY",
                argument="spec",
                value=repr(spec),
                flag="--model",
            ) from e
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            names = sorted(
                n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
            )
            raise UsageError(
                f"{where!r} has no {attribute!r}; callables there: "
                f"{', '.join(names[:15]) or 'none'}",
                argument="spec",
                value=repr(spec),
                flag="--model",
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(
            f"{attribute!r} ({type(factory).__name__}) is not a class or function returning an "
            "nn.Module",
            argument="spec",
            value=repr(spec),
            flag="--model",
        )
    arguments = dict(kwargs or {})
    try:
        signature = inspect.signature(factory)
    except ValueError:
        signature = None  # no signature to check (some builtins): let the call decide
    if signature is not None:
        try:
            signature.bind(**arguments)
        except TypeError as e:
            raise UsageError(
                f"{attribute}{signature} does not take {arguments}: {e}",
                argument="spec",
                value=repr(spec),
                flag="--model",
                remedies=(
                    Remedy(
                        "kwargs",
                        "{'KEY': VALUE}",
                        flag="--model-arg KEY=VALUE",
                        text="with the arguments it takes",
                    ),
                ),
            ) from e
    model = factory(**arguments)
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"returned a {type(model).__name__}, not an nn.Module; point it at a model class or "
            "a function returning a model",
            argument="spec",
            value=repr(spec),
            flag="--model",
        )
    return model
