"""The values a module may keep rather than copy, copied off the file's mapping first.

``load_into`` without ``assign`` maps the file only to copy from it: ``load_state_dict``
copies each value into the module's own parameter or buffer. A module that loads in its
own way keeps what it is handed instead: ``set_extra_state`` storing the tensor it gets
(fp8 scaling statistics), torch's reference quantized modules setting ``weight_scale`` with
``setattr``, a load-state-dict pre-hook. Kept, a view of the mapping would change when the
file is saved again and crash the process when it is truncated; those values are handed
over as copies of their own, as ``torch.load`` would have made them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckpt_tools.loading.rehearsal import own_loading_code

if TYPE_CHECKING:
    from torch import nn

__all__ = ["unmapped_where_kept"]


def unmapped_where_kept(model: nn.Module, sd: Mapping[str, Any]) -> dict[str, Any]:
    """``sd`` with every value a module of ``model`` may keep replaced by a copy.

    Those are the extra states (``*._extra_state``) and every value of a module whose
    ``_load_from_state_dict`` is its own or that has load-state-dict pre-hooks; what the
    stock ``nn.Module._load_from_state_dict`` copies into a parameter or buffer is passed
    on as it is.

    Args:
        model: the model ``sd`` is loaded into.
        sd: the state dict, under the model's keys.

    Returns:
        A new dict of the same keys, in the same order.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> sd = net.state_dict()
        >>> handed = unmapped_where_kept(net, sd)
        >>> handed["0.weight"] is sd["0.weight"], handed["1.weight"] is sd["1.weight"]
        (True, False)
    """
    import torch

    own = own_loading_code(model, torch)

    def kept(key: str) -> bool:
        extra = key == "_extra_state" or key.endswith("._extra_state")
        return extra or any(key.startswith(prefix) for prefix in own)

    return {k: _copied(v) if kept(k) else v for k, v in sd.items()}


def _copied(value: Any) -> Any:
    """``value`` with each tensor in it (an extra state may be a dict of them) cloned."""
    import torch

    if torch.nn.parameter.is_lazy(value):  # uninitialized: no values, nothing mapped
        return value
    if isinstance(value, torch.nn.Parameter):  # clone() would give a plain tensor
        return torch.nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) in (dict, OrderedDict, list, tuple):  # what the restricted reader builds
        if isinstance(value, Mapping):
            return type(value)((k, _copied(v)) for k, v in value.items())
        return type(value)(_copied(v) for v in value)
    return value
