"""``merge_lora``: a PEFT LoRA adapter merged into its base checkpoint, streamed, torch-free.

The adapter's modules are found under the base's keys (``<module>.weight``), wrapper prefixes
aligned away as ``average`` aligns them. Each merged weight is a producer record in the plan
every transform builds (:mod:`ckpt_tools.ops.transform.state_dict_plan`); every other tensor
is copied as rewrites copy it, so it is bitwise the base's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ckpt_tools._types import (
    OutputFormat,
    Progress,
    Select,
    StrPath,
    VerifyLevel,
    checked_flags,
    checked_path,
    str_items,
)
from ckpt_tools.descriptors import TensorRef
from ckpt_tools.errors import ConversionError, SameFileError, UsageError
from ckpt_tools.formats import Checkpoint, open_checkpoint, refuse_url
from ckpt_tools.io.output_path import (
    check_output_folder,
    check_output_path,
    resolved_output,
    wants_folder,
)
from ckpt_tools.io.writers.records import Record
from ckpt_tools.ops.merge.adapter import (
    CONFIG_NAME,
    WEIGHT_NAMES,
    LoraAdapter,
    LoraTarget,
    read_adapter,
)
from ckpt_tools.ops.merge.folder import write_merged_folder
from ckpt_tools.ops.merge.layout import (
    aligned_names,
    base_config,
    conv1d_layouts,
    tied_embedding,
)
from ckpt_tools.ops.merge.records import MergeStep, bias_record, merge_record
from ckpt_tools.ops.merge.replacements import check_whole as _check_whole
from ckpt_tools.ops.merge.replacements import plan_replacements
from ckpt_tools.ops.merge.result import MergedModule, MergeResult
from ckpt_tools.ops.preflight import check_key_types, check_rewritable
from ckpt_tools.ops.rewrite.plan import format_family, output_format_for, torch_instead
from ckpt_tools.ops.transform.slim import cast_target
from ckpt_tools.ops.transform.state_dict_plan import finish, plan_state_dict_output
from ckpt_tools.structure.selection import select_state_dict

__all__ = ["merge_lora"]

_FLOATING = ("float64", "float32", "float16", "bfloat16")


@checked_flags
def merge_lora(
    base: StrPath,
    adapter: StrPath,
    dst: StrPath,
    *,
    dtype: str | None = None,
    select: Select = None,
    output_format: OutputFormat | None = None,
    max_shard_size: str | int | None = None,
    drop_extras: bool = False,
    fan_in_fan_out: bool | None = None,
    allow_globals: Sequence[str] = (),
    force: bool = False,
    verify: VerifyLevel = "sizes",
    durable: bool = True,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> MergeResult:
    """Merge a PEFT LoRA adapter into its base checkpoint, as PEFT's ``merge_and_unload`` does.

    ``W += transpose(B @ A) * scaling`` for Linear, GPT-2 ``Conv1D`` (``fan_in_fan_out``) and
    Embedding targets (a convolution's kernels as the rows of A), in float32 and rounded once
    to the weight's dtype, in PEFT's order (rsLoRA, ``rank_pattern`` and ``alpha_pattern`` as
    PEFT resolves them); DoRA rescales each output row (an embedding's each column) by its
    magnitude over its norm; targets that share one tied weight (an output head tied to the
    input embeddings, saved or left out of an HF folder) are merged into it in turn, and the
    tie is kept; ``modules_to_save`` copies replace the base's tensors, and so do the trained
    biases of ``bias="lora_only"`` or ``"all"`` (copied in the base's dtype, as loading copies
    them; ``lora_bias`` then merges into the trained bias). Every other tensor is copied
    bitwise. One merged tensor is in memory at a time, and torch is never imported.

    Args:
        base: the base checkpoint: a ``.pt``, ``.safetensors`` or Hugging Face folder (sharded
            or not), with or without a wrapper prefix (``module.``).
        adapter: a PEFT adapter folder (``adapter_config.json`` and
            ``adapter_model.safetensors`` or ``.bin``, read without running its pickle).
        dst: the output, a plain state dict under the base's keys: a file (its suffix picks
            torch or safetensors), or a Hugging Face folder of safetensors shards when it ends
            with ``/``, is an existing folder, or ``max_shard_size`` is given.
        dtype: ``bf16``, ``fp16`` or ``fp32`` (or another spelling :func:`slim` takes): cast
            the merged state dict's floating tensors
            (the merge rounds to the base's dtype first, as merging then ``.to`` does).
        max_shard_size: a folder output's shard limit (``"5GB"`` when None), as for
            :func:`~ckpt_tools.ops.rewrite.conversion.convert`.
        fan_in_fan_out: whether square weights that nothing else settles are GPT-2 ``Conv1D``
            (True) or Linear (False). A weight that is not square says so itself, and a base
            with a ``config.json`` (an HF folder) says so by its ``model_type``; else the
            adapter's saved ``fan_in_fan_out`` is its last target's kind only, and a square
            target it does not settle is refused unless this is given.
        select, output_format, drop_extras, allow_globals, force, verify, durable, dry_run,
            progress: as for :func:`~ckpt_tools.ops.transform.slim.slim`; ``allow_globals``
            also applies to a pickled adapter.

    Returns:
        A :class:`~ckpt_tools.ops.merge.result.MergeResult` (``merged``: each module with its
        rank, alpha and scaling; ``replaced``: the ``modules_to_save`` keys; ``biases``: the
        keys given the adapter's trained biases).

    Raises:
        ConversionError: an adapter type other than LoRA, a LoRA variant PEFT does not merge as
            LoRA, a target missing from the base, a shape that does not fit, or a square
            weight whose layout nothing settles (exit 7), each named.
        UnsafeContentError: a pickled adapter or base names a global outside the allowlist.
        UsageError: ``base`` or ``adapter`` is a URL, a bad ``dtype`` or ``verify``.
        NonTensorEntriesError: a safetensors output, non-tensor entries in the base's state
            dict and not ``drop_extras`` (exit 7).
        OutputExistsError / OutputError: the output is refused (exit 6).

    Example:
        >>> result = merge_lora("model.pt", "lora", "merged.pt")
        >>> [(m.key, m.r, m.scaling) for m in result.merged]
        [('layers.0.weight', 2, 2.0), ('head.weight', 2, 2.0)]
    """
    base, adapter, dst = _local_paths(base, adapter, dst)
    cast_to, allow_globals = cast_target(dtype), str_items(allow_globals, "allow_globals")
    folder = wants_folder(dst, max_shard_size)
    _refuse_adapter_output(dst, adapter)  # before check_output_* offers force
    if folder:
        _check_folder_format(dst, output_format)
        target = check_output_folder(dst, base, force=force)
        check_output_folder(dst, adapter, force=force)  # nor the adapter's folder, nor above
    else:
        target = check_output_path(dst, base, force=force, in_place=None)
    lora = read_adapter(adapter, allow_globals)
    if not folder:  # nor may OUT be the adapter's weight file
        check_output_path(dst, lora.weights, force=force, in_place=None)
    ckpt = open_checkpoint(base)
    selection = select_state_dict(ckpt.root, select=select)
    check_rewritable(ckpt, allow_globals, selection.path)
    aligned = aligned_names(sd := selection.state_dict, lora)
    merged, overrides, actions = _plan_merges(
        ckpt, aligned, lora, config := base_config(base), fan_in_fan_out
    )
    replaced, biases, untied = plan_replacements(aligned, lora, overrides, actions, config)
    items = _items(sd, untied)
    fmt = "safetensors" if folder else output_format_for(dst, output_format, format_family(ckpt))
    check_key_types(sd, (), fmt, base)  # (safetensors names tensors by strings only)
    plan = plan_state_dict_output(
        ckpt,
        "merge-lora",
        dst,
        fmt,
        selection,
        items,
        weights_only=True,
        drop_extras=drop_extras,
        cast_to=cast_to,
        overrides=overrides,
        to_torch=torch_instead(dst, folder=folder),
    )
    rows = tuple(
        replace(r, action=actions[r.source_key]) if r.source_key in actions else r
        for r in plan.rows
    )
    plan = replace(plan, rows=rows, sources=(base, lora.weights))
    done = finish(plan, target, ckpt, verify, dry_run or folder, durable, progress, replace=force)
    if folder:
        done = write_merged_folder(
            plan,
            replace(done, dry_run=dry_run),
            target,
            ckpt,
            max_shard_size=max_shard_size,
            verify=verify,
            durable=durable,
            progress=progress,
            force=force,
        )
    shared = {f.name: getattr(done, f.name) for f in fields(done) if f.init}
    return MergeResult(
        **shared, adapter=adapter, merged=tuple(merged), replaced=replaced, biases=biases
    )


def _items(sd: Mapping[Any, Any], untied: Mapping[str, TensorRef]) -> list[tuple[Any, Any, Any]]:
    """The output's entries: the base's, a saved copy in place of a tensor it unties, then the
    saved modules the base lacks. Keys of other types (an int) are no adapter's names: copied
    as they are."""
    items = [(k, k, untied.get(k, v) if isinstance(k, str) else v) for k, v in sd.items()]
    return items + [(k, k, t) for k, t in untied.items() if k not in sd]


def _local_paths(base: StrPath, adapter: StrPath, dst: StrPath) -> tuple[str, str, str]:
    """The three paths as strings, each a path and the inputs local (a URL is refused before
    the adapter's config is looked for)."""
    paths = checked_path(base, "base"), checked_path(adapter, "adapter"), checked_path(dst, "dst")
    refuse_url(paths[0])
    refuse_url(paths[1])
    return paths


def _check_folder_format(dst: str, output_format: str | None) -> None:
    if output_format not in (None, "safetensors"):
        raise UsageError(
            f"{dst!r} is a folder output, which holds safetensors shards",
            argument="output_format",
            value=repr(output_format),
            flag="--format",
        )


def _plan_merges(
    ckpt: Checkpoint,
    aligned: Mapping[str, tuple[str, TensorRef]],
    lora: LoraAdapter,
    config: Mapping[str, Any] | None,
    fan_in_fan_out: bool | None,
) -> tuple[list[MergedModule], dict[int, Record], dict[str, str]]:
    """Each target's base weight found and checked, and the record that merges into it.

    Targets sharing one storage (tied embeddings) are merged into it in turn, in the base's
    order of keys (the model's order of modules, in which PEFT merges them).

    Raises:
        ConversionError: targets missing from the base or whose shapes do not fit, all named;
            square weights whose layout nothing settles.
    """
    found, problems = _found_targets(aligned, lora, config)
    linear = [(t, w) for t, _, w in found if t.kind == "linear"]
    conv1d = conv1d_layouts(linear, lora.config, config, fan_in_fan_out) if not problems else {}
    order = {key: n for n, (key, _) in enumerate(aligned.values())}
    groups: dict[int, list[tuple[LoraTarget, str, TensorRef]]] = {}
    # A head tied to an embedding is its model's last module: merged after the embedding;
    # of the tied modules left out of the base, an encoder's comes before a decoder's.
    ranked = sorted(
        found,
        key=lambda f: (order[f[1]], f"{f[0].module}.weight" not in aligned, _stack(f[0].module)),
    )
    for t, key, weight in ranked:
        groups.setdefault(id(weight.storage), []).append((t, key, weight))
    merged: list[MergedModule] = []
    overrides: dict[int, Record] = {}
    actions: dict[str, str] = {}
    for storage, group in groups.items():
        steps = [
            MergeStep(t, t.kind == "embedding" or conv1d.get(t.module, False)) for t, _, _ in group
        ]
        start = next(
            (lora.base_layers[t.module] for t, _, _ in group if t.module in lora.base_layers), None
        )
        weight = group[0][2]
        overrides[storage] = merge_record(ckpt, weight, lora.ckpt, steps, start)
        words = ", then ".join(
            f"{_kind(s)} r={s.target.r} scaling={s.target.scaling:g}" for s in steps
        )
        for (t, key, _), step in zip(group, steps):
            actions[key] = f"merge {words}"
            merged.append(MergedModule(t.module, key, _kind(step), t.r, t.alpha, t.scaling))
            if t.bias is not None:
                problems += _plan_lora_bias(ckpt, aligned, lora, t, overrides, actions)
    if problems:
        raise ConversionError(
            f"the adapter does not fit the base: {'; '.join(problems[:8])}"
            + (f"; ... {len(problems) - 8} more" if len(problems) > 8 else "")
        )
    return merged, overrides, actions


def _stack(module: str) -> int:
    """Where ``module`` lies in an encoder-decoder model's order of modules (transformers
    builds the encoder first, the decoder next, then the head)."""
    parts = module.split(".")
    return 0 if "encoder" in parts else 1 if "decoder" in parts else 2


def _found_targets(
    aligned: Mapping[str, tuple[str, TensorRef]],
    lora: LoraAdapter,
    config: Mapping[str, Any] | None,
) -> tuple[list[tuple[LoraTarget, str, TensorRef]], list[str]]:
    """Each target with the key and base weight it merges into, and the problems found."""
    problems: list[str] = []
    found: list[tuple[LoraTarget, str, TensorRef]] = []
    for t in lora.targets:
        hit = aligned.get(f"{t.module}.weight")
        if hit is None:
            hit, why = tied_embedding(t, aligned, config)
            if hit is None:
                problems.append(why)
                continue
        key, weight = hit
        why = _misfit(t, weight)
        if why:
            problems.append(f"{key}: {why}")
            continue
        _check_whole(key, weight)
        start = lora.base_layers.get(t.module)
        if start is not None and start.shape != weight.shape:
            problems.append(f"{key}: the adapter's copy is {list(start.shape)} (resized?)")
            continue
        found.append((t, key, weight))
    return found, problems


def _plan_lora_bias(
    ckpt: Checkpoint,
    aligned: Mapping[str, tuple[str, TensorRef]],
    lora: LoraAdapter,
    t: LoraTarget,
    overrides: dict[int, Record],
    actions: dict[str, str],
) -> list[str]:
    """The record merging ``lora_B.bias`` into the base's bias, or the problem found.

    PEFT loads a trained bias (``bias="lora_only"`` or ``"all"``) before it merges, so the
    merge then starts from the adapter's bias instead of the base's.
    """
    assert t.bias is not None
    name = f"{t.module}.bias"
    bias = aligned.get(name)
    if bias is None or bias[1].shape != t.bias.shape:
        return [f"{name} (lora_bias needs a base bias of its shape)"]
    trained = lora.biases.get(name)
    if trained is not None and trained.shape != t.bias.shape:
        return [f"{name} (trained bias: shape differs)"]
    _check_whole(bias[0], bias[1])
    overrides[id(bias[1].storage)] = bias_record(ckpt, bias[1], lora.ckpt, t, trained)
    onto = " onto the trained bias" if trained is not None else ""
    actions[bias[0]] = f"merge lora bias{onto} scaling={t.scaling:g}"
    return []


def _misfit(t: LoraTarget, weight: TensorRef) -> str:
    """Why the weight does not fit the target's A and B, or "" (the layout is decided later)."""
    r_out, r_in = t.b.shape[0], t.a.shape[1]
    if weight.dtype not in _FLOATING:
        return f"a {weight.dtype} weight cannot be merged"
    # lora_embedding_A is (r, num_embeddings), B is (dim, r); the weight (num_embeddings, dim).
    wanted = [(r_in, r_out)] if t.kind == "embedding" else [(r_out, r_in), (r_in, r_out)]
    if t.kind == "convolution":  # A's kernel is the weight's
        wanted = [(r_out, r_in, *t.a.shape[2:])]
    if weight.shape in wanted:
        return ""
    return (
        f"shape {list(weight.shape)} does not fit lora_A {list(t.a.shape)} and "
        f"lora_B {list(t.b.shape)} (expected {list(wanted[0])})"
    )


def _kind(step: MergeStep) -> str:
    t = step.target
    kind = t.kind if t.kind != "linear" else ("conv1d" if step.transpose else "linear")
    return kind + ("+dora" if t.magnitude is not None else "")


def _refuse_adapter_output(dst: str, adapter: str) -> None:
    """Refuse an output named as a file PEFT reads in the adapter folder (its config, its
    weights), present or not: the adapter is an input, and ``force`` replaces no file of
    it. Any other output written into the folder is fine, and replaced with ``force`` as
    any output is."""
    out, inputs = resolved_output(dst), Path(adapter).resolve()
    names = (CONFIG_NAME, *WEIGHT_NAMES)
    # By real paths: a linked folder on the way, or files that are links (a hub cache's).
    read = {(inputs / name).resolve() for name in names if (inputs / name).exists()}
    if (out.parent.resolve() == inputs and out.name in names) or out.resolve() in read:
        raise SameFileError(dst, offer_in_place=False, folder=adapter)
