"""What merge_lora did, or with ``dry_run`` would do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tools.ops.transform.result import TransformResult
from ckpt_tools.structure.json_values import json_ready

__all__ = ["MergeResult", "MergedModule"]


@dataclass(frozen=True)
class MergedModule:
    """One adapted module merged into the base.

    Attributes:
        module: its path in the model, as PEFT names it.
        key: the base key of the weight it changes.
        kind: ``linear``, ``conv1d`` (``fan_in_fan_out``), ``convolution`` (``nn.Conv1d``,
            ``Conv2d``, ``Conv3d``), ``embedding``; ``+dora`` for DoRA.
        r, alpha, scaling: its rank, alpha and the scaling applied.
    """

    module: str
    key: str
    kind: str
    r: int
    alpha: float
    scaling: float

    def to_json(self) -> dict[str, Any]:
        # A config's alpha may be infinite: strict JSON names it ("inf"), as --json prints.
        return json_ready(
            {
                "module": self.module,
                "key": self.key,
                "kind": self.kind,
                "r": self.r,
                "alpha": self.alpha,
                "scaling": self.scaling,
            }
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class MergeResult(TransformResult):
    """The outcome of :func:`~ckpt_tools.ops.merge.merging.merge_lora`: the fields of
    :class:`~ckpt_tools.ops.transform.result.TransformResult`, and

    Attributes:
        adapter: the adapter folder.
        merged: one entry per merged module (rank, alpha, scaling).
        replaced: base keys replaced by their ``modules_to_save`` copies.
        biases: base keys given the adapter's trained biases (``bias="lora_only"`` or
            ``"all"``), a ``lora_bias`` merged into them where the module has one.
    """

    adapter: str = ""
    merged: tuple[MergedModule, ...] = ()
    replaced: tuple[str, ...] = ()
    biases: tuple[str, ...] = ()

    def details(self) -> list[str]:
        """One line per merged module, then the transform's lines."""
        lines = [
            f"  merge {m.kind:<16} {m.key}  r={m.r} alpha={m.alpha:g} scaling={m.scaling:g}"
            for m in self.merged
        ]
        lines += [f"  replace (modules_to_save) {key}" for key in self.replaced]
        lines += [f"  replace (trained bias)    {key}" for key in self.biases]
        return lines + super().details()

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data: the transform's fields, ``adapter``, ``merged``, ``replaced`` and
        ``biases``."""
        return {
            **super().to_json(),
            "adapter": self.adapter,
            "merged": [m.to_json() for m in self.merged],
            "replaced": list(self.replaced),
            "biases": list(self.biases),
        }
