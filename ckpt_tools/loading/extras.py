"""The packages only the ``torch`` extra installs, imported when a feature first needs them.

``pip install ckpt_tools`` brings what the torch-free paths use (numpy, click, tabulate):
``inspect``, ``scan``, every rewrite, ``convert``, ``slim``, ``extract``, ``average``,
``consolidate``, ``sanitize``. ``pip install 'ckpt_tools[torch]'`` adds torch and safetensors
for loading, value diffs, devices and the harness. Each of those asks here before it imports
torch, so a missing package is one error,
:class:`~ckpt_tools.errors.MissingExtraError` (exit 2), that names the feature and the extra,
instead of a ``ModuleNotFoundError`` from deep inside.
"""

from __future__ import annotations

from types import ModuleType

from ckpt_tools.errors import MissingExtraError

__all__ = ["require_safetensors", "require_torch"]


def require_torch(feature: str) -> ModuleType:
    """``torch``, imported; or the error that says ``feature`` needs the ``torch`` extra.

    Args:
        feature: what needs torch, as its caller knows it (``"load_state_dict"``,
            ``"ckpt diff"``); the error starts with it.

    Returns:
        The ``torch`` module.

    Raises:
        MissingExtraError: torch is not installed
            ("load_state_dict needs torch: pip install 'ckpt_tools[torch]'").

    Example:
        >>> require_torch("load_state_dict").__name__
        'torch'
    """
    try:
        import torch
    except ModuleNotFoundError as e:
        _reraise_unless_missing(e, "torch")
        raise MissingExtraError(feature, "torch", "torch") from e
    return torch


def require_safetensors(feature: str) -> ModuleType:
    """``safetensors.torch``, imported (torch first); or the error naming the ``torch`` extra.

    Only a loader that hands a safetensors file to the safetensors package (``trust=True``)
    needs it: every other path reads and writes safetensors files itself.

    Args:
        feature: what needs it, as its caller knows it.

    Returns:
        The ``safetensors.torch`` module.

    Raises:
        MissingExtraError: torch or safetensors is not installed.

    Example:
        >>> require_safetensors("load_state_dict(trust=True)").load_file.__name__
        'load_file'
    """
    require_torch(feature)
    try:
        import safetensors.torch
    except ModuleNotFoundError as e:
        _reraise_unless_missing(e, "safetensors")
        raise MissingExtraError(feature, "safetensors", "torch") from e
    return safetensors.torch


def _reraise_unless_missing(error: ModuleNotFoundError, package: str) -> None:
    # Only the package itself missing is a missing extra. An installed torch whose own
    # dependency is missing is a broken install, and its own error says which.
    name = error.name or ""
    if name != package and not name.startswith(package + "."):
        raise error
