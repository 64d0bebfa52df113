"""Wrapper detection and in-memory key rewrites (``structure.keys``), checked against torch."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import ckpt_tools
from ckpt_tools.errors import KeyCollisionError, ResourceLimitError, UsageError
from ckpt_tools.structure.keys import (
    KeyRule,
    add_rule,
    plan_renames,
    regex_rule,
    rename_keys,
    strip_rule,
    sub_rule,
)
from ckpt_tools.structure.wrappers import (
    MAX_WRAPPER_DEPTH,
    WRAPPER_RULES,
    add_prefix,
    detect_wrappers,
    strip_prefix,
    strip_wrapper_rules,
)
from tests import helpers as h

BARE = ["embed.weight", "body.0.weight", "body.0.bias", "norm.running_mean", "head.weight"]


def prefixed(prefix: str, keys=BARE) -> list[str]:
    return [prefix + k for k in keys]


def found(keys) -> list[tuple[str, int, int, bool]]:
    return [(m.prefix, m.count, m.of, m.inner) for m in detect_wrappers(keys)]


# --------------------------------------------------------------------------------------------
# detect_wrappers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "kind"),
    [
        ("module.", "DataParallel"),
        ("_orig_mod.", "torch.compile"),
        ("_fsdp_wrapped_module.", "FullyShardedDataParallel"),
        ("_checkpoint_wrapped_module.", "checkpoint_wrapper"),
        ("_forward_module.", "_forward_module"),
        ("base_model.model.", "PeftModel"),
        ("model.", "Lightning"),
    ],
)
def test_each_wrapper_at_the_start_of_every_key(prefix, kind):
    (match,) = detect_wrappers(prefixed(prefix))
    assert (match.prefix, match.count, match.of, match.inner) == (prefix, 5, 5, False)
    assert kind in match.kind
    want = {"prefix": prefix, "kind": match.kind, "count": 5, "of": 5, "inner": False}
    assert match.to_json() == want
    assert {r.prefix for r in WRAPPER_RULES} >= {prefix}


def test_real_wrapped_modules():
    model = h.make_model()
    assert found(h.data_parallel(model).state_dict()) == [("module.", 11, 11, False)]
    assert found(h.Compiled(model).state_dict()) == [("_orig_mod.", 11, 11, False)]
    assert found(h.LitModule(model).state_dict()) == [("model.", 11, 11, False)]
    assert found(model.state_dict()) == []


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (prefixed("module._orig_mod."), ["module.", "_orig_mod."]),
        (prefixed("_orig_mod.module."), ["_orig_mod.", "module."]),
        (
            prefixed("module._orig_mod._fsdp_wrapped_module."),
            ["module.", "_orig_mod.", "_fsdp_wrapped_module."],
        ),
        (prefixed("_forward_module.module."), ["_forward_module.", "module."]),
        (prefixed("_forward_module.model."), ["_forward_module.", "model."]),
        (prefixed("model._orig_mod."), ["model.", "_orig_mod."]),
    ],
)
def test_stacked_wrappers_are_peeled_outermost_first(keys, expected):
    assert [m.prefix for m in detect_wrappers(keys)] == expected
    assert all(m.count == m.of == len(keys) and not m.inner for m in detect_wrappers(keys))
    rules, _ = strip_wrapper_rules(keys)
    assert list(plan_renames(keys, rules).values()) == BARE


@pytest.mark.parametrize(
    ("outer", "expected"),
    [
        ("module.", ["module."]),
        ("_orig_mod.", ["_orig_mod."]),
        ("base_model.model.", ["base_model.model."]),
        ("model.", ["model."]),
    ],
)
def test_lightnings_model_is_only_the_outermost_prefix(outer, expected):
    # Under another wrapper, `model.` is the wrapped model's own attribute: it stays.
    keys = prefixed(outer + "model.")
    assert [m.prefix for m in detect_wrappers(keys)] == expected
    rules, _ = strip_wrapper_rules(keys)
    assert list(plan_renames(keys, rules).values()) == [f"model.{k}" for k in BARE]
    # Lining two sets of keys up, every layer is peeled.
    assert [m.prefix for m in detect_wrappers(keys, anywhere=True)] == [outer, "model."]
    rules, _ = strip_wrapper_rules(keys, anywhere=True)
    assert list(plan_renames(keys, rules).values()) == BARE


def test_wrapper_stack_up_to_the_limit_is_peeled_like_torch():
    sd = {"module." * MAX_WRAPPER_DEPTH + k: torch.zeros(1) for k in BARE}
    assert [m.prefix for m in detect_wrappers(sd)] == ["module."] * MAX_WRAPPER_DEPTH
    stripped = collections.OrderedDict(sd)
    for _ in range(MAX_WRAPPER_DEPTH):  # torch's helper strips one layer a call
        consume_prefix_in_state_dict_if_present(stripped, "module.")
    rules, _ = strip_wrapper_rules(list(sd))
    assert list(plan_renames(list(sd), rules).values()) == list(stripped) == BARE


def test_wrapper_stack_past_the_limit_is_refused():
    # One key among many with a deep stack: each layer is a pass over every key.
    keys = BARE * 100 + ["_orig_mod." * (MAX_WRAPPER_DEPTH + 1) + "w"]
    with pytest.raises(ResourceLimitError, match=f"more than {MAX_WRAPPER_DEPTH} wrapper"):
        detect_wrappers(keys)
    with pytest.raises(ResourceLimitError):
        strip_wrapper_rules(keys)


def test_real_stacked_wrappers():
    model = h.make_model()
    assert [m.prefix for m in detect_wrappers(h.data_parallel(h.Compiled(model)).state_dict())] == [
        "module.",
        "_orig_mod.",
    ]
    assert [m.prefix for m in detect_wrappers(h.Compiled(h.data_parallel(model)).state_dict())] == [
        "_orig_mod.",
        "module.",
    ]


@pytest.mark.parametrize("segment", ["_fsdp_wrapped_module.", "_checkpoint_wrapped_module."])
def test_inner_segments(segment):
    keys = [
        f"blocks.0.{segment}fc.weight",
        f"blocks.1.{segment}fc.weight",
        "blocks.2.fc.weight",
        f"x{segment}y",  # not a segment: no dot before it
    ]
    assert found(keys) == [(segment, 2, 4, True)]
    rules, _ = strip_wrapper_rules(keys)
    assert list(plan_renames(keys, rules).values()) == [
        "blocks.0.fc.weight",
        "blocks.1.fc.weight",
        "blocks.2.fc.weight",
        f"x{segment}y",
    ]


def test_fsdp_prefix_and_inner_segments_together():
    keys = [
        "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.w",
        "_fsdp_wrapped_module.layers.1._fsdp_wrapped_module._checkpoint_wrapped_module.w",
        "_fsdp_wrapped_module.head.w",
    ]
    assert found(keys) == [
        ("_fsdp_wrapped_module.", 3, 3, False),
        ("_fsdp_wrapped_module.", 2, 3, True),
        ("_checkpoint_wrapped_module.", 2, 3, True),
    ]
    rules, _ = strip_wrapper_rules(keys)
    assert list(plan_renames(keys, rules).values()) == ["layers.0.w", "layers.1.w", "head.w"]


def test_model_and_peft_prefixes_only_when_every_key_has_them():
    # `model.` is also a plain attribute name: a model with a `model` submodule and others.
    mixed = ["model.fc.weight", "model.fc.bias", "classifier.weight"]
    assert found(mixed) == []
    peft = prefixed("base_model.model.")
    assert found([*peft, "lm_head.weight"]) == []
    assert found(peft) == [("base_model.model.", 5, 5, False)]
    # `module.` too: DataParallel and DDP prefix every key, so a partial set is an attribute
    # named `module` (an EMA helper's), and DataParallel around one is peeled once.
    assert found(["module.a.w", "module.b.w", "c.w"]) == []
    assert found(["module.module.w", "module.other.w"]) == [("module.", 2, 2, False)]
    # A non-tensor entry (an `epoch` saved inside the state dict) is no module's tensor.
    t = torch.ones(1)
    assert found({"module.a": t, "module.b": t, "epoch": 3}) == [("module.", 2, 2, False)]
    assert found({"model.fc.weight": t, "step": 5}) == [("model.", 1, 1, False)]


def test_no_wrappers_and_odd_keys():
    assert detect_wrappers([]) == ()
    assert detect_wrappers(BARE) == ()
    assert detect_wrappers(["modulex.a", "_orig_modx.b"]) == ()
    assert found([0, "module.a"]) == [("module.", 1, 1, False)]  # non-string keys ignored


# --------------------------------------------------------------------------------------------
# strip_prefix / add_prefix and torch's consume_prefix_in_state_dict_if_present
# --------------------------------------------------------------------------------------------


def with_metadata(sd, metadata):
    sd = collections.OrderedDict(sd)
    sd._metadata = collections.OrderedDict(metadata)
    return sd


def torch_strip(sd, prefix: str):
    """torch's own strip, on a copy (it edits in place)."""
    sd = with_metadata(sd, sd._metadata)
    consume_prefix_in_state_dict_if_present(sd, prefix)
    return sd


@pytest.mark.parametrize(
    "wrapped",
    [
        lambda: h.data_parallel(h.make_model()),
        lambda: h.data_parallel(nn.BatchNorm1d(3)),  # the root has _version 2, the wrapper 1
        lambda: h.data_parallel(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))),
    ],
)
def test_strip_prefix_matches_consume_prefix_in_state_dict_if_present(wrapped):
    sd = wrapped().state_dict()
    ours = strip_prefix(sd, prefix="module.")
    theirs = torch_strip(sd, "module.")
    assert type(ours) is collections.OrderedDict
    assert list(ours) == list(theirs)
    assert all(ours[k] is theirs[k] for k in ours)
    assert list(ours._metadata.items()) == list(theirs._metadata.items())
    assert list(sd) == [f"module.{k}" for k in ours]  # the input is left as it was
    assert "module" in sd._metadata


def test_strip_prefix_stacked_matches_torch_applied_twice():
    sd = h.data_parallel(h.Compiled(nn.BatchNorm1d(3))).state_dict()
    ours = strip_prefix(strip_prefix(sd, prefix="module."), prefix="_orig_mod.")
    theirs = torch_strip(torch_strip(sd, "module."), "_orig_mod.")
    bn_keys = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert list(ours) == list(theirs) == bn_keys
    assert list(ours._metadata.items()) == list(theirs._metadata.items())
    assert ours._metadata[""] == {"version": 2}  # the BatchNorm's own, as torch keeps it
    rules, _ = strip_wrapper_rules(list(sd))
    assert list(rename_keys(sd, rules)._metadata.items()) == list(theirs._metadata.items())


def test_strip_prefix_on_a_partly_prefixed_state_dict():
    sd = with_metadata(
        {"module.a": torch.ones(1), "b": torch.ones(1), "module.c.w": torch.ones(1)},
        {"": {"version": 1}, "module": {"version": 3}, "module.c": {"version": 4}, "x": {}},
    )
    ours = strip_prefix(sd)
    theirs = torch_strip(sd, "module.")
    assert list(ours) == ["a", "b", "c.w"]  # order kept (torch moves renamed keys last)
    assert dict(ours) == dict(theirs)
    assert dict(ours._metadata) == dict(theirs._metadata)


def test_bare_model_loads_stripped_state_dict_with_its_metadata():
    bn = nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.running_mean.fill_(0.5)
    stripped = strip_prefix(h.data_parallel(bn).state_dict())
    fresh = nn.BatchNorm1d(3)
    fresh.load_state_dict(stripped, strict=True)
    assert torch.equal(fresh.running_mean, bn.running_mean)


def test_add_prefix_is_what_dataparallel_saves_and_loads():
    model = h.make_model()
    sd = model.state_dict()
    wrapped = add_prefix(sd)
    reference = h.data_parallel(model).state_dict()
    assert list(wrapped) == list(reference)
    assert all(wrapped[k] is sd[k.removeprefix("module.")] for k in wrapped)
    assert list(wrapped._metadata.items()) == list(reference._metadata.items())

    dp = h.data_parallel(h.make_model(seed=1))
    dp.load_state_dict(wrapped, strict=True)
    for k, v in sd.items():
        assert torch.equal(dp.module.state_dict()[k], v)
    # And back: strip undoes add, metadata included.
    back = strip_prefix(wrapped)
    assert list(back) == list(sd)
    assert list(back._metadata.items()) == list(sd._metadata.items())


def test_add_prefix_with_several_levels_and_without_metadata():
    model = h.make_model()
    stacked = add_prefix(model.state_dict(), prefix="module._orig_mod.")
    reference = h.data_parallel(h.Compiled(model)).state_dict()
    assert list(stacked) == list(reference)
    assert list(stacked._metadata.items()) == list(reference._metadata.items())
    h.data_parallel(h.Compiled(h.make_model(seed=2))).load_state_dict(stacked, strict=True)

    plain = {"w": 1, "b": 2}
    out = add_prefix(plain, prefix="m.")
    assert out == {"m.w": 1, "m.b": 2} and type(out) is dict
    assert add_prefix({"w": 1}, prefix="a\\b.") == {"a\\b.w": 1}  # no regex escapes in prefixes


# --------------------------------------------------------------------------------------------
# rename_keys, rules, collisions
# --------------------------------------------------------------------------------------------


def test_rename_keys_with_sub_and_regex_rules():
    sd = with_metadata(
        {
            "backbone.layers.0.weight": torch.ones(1),
            "backbone.layers.1.weight": torch.ones(2),
            "head.backbone.bias": torch.ones(3),
        },
        {"": {}, "backbone": {"v": 1}, "backbone.layers.0": {"v": 2}, "head": {"v": 3}},
    )
    rules = [
        sub_rule("backbone.", "encoder."),
        regex_rule(r"\.layers\.(\d+)\.", r".blocks.\1."),
        regex_rule(r"weight$", "w"),
    ]
    out = rename_keys(sd, rules)
    assert list(out) == ["encoder.blocks.0.w", "encoder.blocks.1.w", "head.backbone.bias"]
    assert [v.numel() for v in out.values()] == [1, 2, 3]
    assert all(a is b for a, b in zip(out.values(), sd.values()))
    assert list(out._metadata) == ["", "encoder", "encoder.blocks.0", "head"]
    assert [r.description for r in rules] == [
        "'backbone.' -> 'encoder.'",
        r"s/\.layers\.(\d+)\./.blocks.\1./",
        "s/weight$/w/",
    ]
    assert next(iter(sd)) == "backbone.layers.0.weight"  # the input is left as it was


def test_rule_texts_are_literal_where_they_should_be():
    assert sub_rule("a.", r"b\1.").apply("a.x") == r"b\1.x"  # a prefix map is literal
    assert sub_rule("a.b", "c").apply("axb.w") == "axb.w"  # dots are not wildcards
    assert add_rule("p.").apply("w") == "p.w"
    assert strip_rule("module.").apply("module.module.w") == "module.w"  # once, at the start
    assert strip_rule("module.").apply("x.module.w") == "x.module.w"
    assert regex_rule("o", "0").apply("foo.bo") == "f00.b0"  # a regex replaces every match


@pytest.mark.parametrize("pattern", ["(unclosed", "[z-a]", "*x", "a{2,1}"])
def test_bad_regex_is_a_usage_error(pattern):
    with pytest.raises(UsageError, match="not a valid regular expression") as info:
        regex_rule(pattern, "x")
    assert isinstance(info.value, ValueError) and info.value.exit_code == 2


def test_collisions_name_both_keys():
    with pytest.raises(KeyCollisionError, match=r"'module\.w' and 'w' -> 'w'") as info:
        strip_prefix({"module.w": 1, "w": 2})
    assert info.value.collisions == (("w", ("module.w", "w")),)
    assert info.value.exit_code == 7 and isinstance(info.value, ValueError)

    with pytest.raises(KeyCollisionError, match=r"'a\.1' and 'a\.2' -> 'a\.N'"):
        rename_keys({"a.1": 1, "a.2": 2}, [regex_rule(r"\d", "N")])
    with pytest.raises(KeyCollisionError, match=r"'x\.w' and 'y\.w' -> 'z\.w'"):
        rename_keys({"x.w": 1, "y.w": 2}, [sub_rule("x.", "z."), sub_rule("y.", "z.")])


def test_many_collisions_are_summarised():
    sd = {k: 0 for i in range(5) for k in (f"module.k{i}", f"k{i}")}
    with pytest.raises(KeyCollisionError, match=r"merge 5 pair\(s\).* \.\.\.;") as info:
        strip_prefix(sd)
    assert len(info.value.collisions) == 5


def test_plan_renames_keeps_order_and_unchanged_keys():
    keys = ["module.b", "a", "module.c"]
    assert plan_renames(keys, [strip_rule("module.")]) == {
        "module.b": "b",
        "a": "a",
        "module.c": "c",
    }
    assert list(plan_renames(keys, [])) == keys


@pytest.mark.parametrize(
    ("pattern", "replacement", "said"),
    [
        ("conv", r"\9", "invalid group reference 9"),
        ("conv", r"\g<x>", "unknown group name 'x'"),
        (r"(\d+)", r"\2", "invalid group reference 2"),
        ("conv", r"\q", r"bad escape \q"),
    ],
)
def test_a_replacement_that_does_not_fit_its_pattern_is_refused_when_the_rule_is_made(
    pattern, replacement, said
):
    # Refused as the rule is made, naming it, not as re's own error once keys are renamed.
    for make in (regex_rule, KeyRule):
        with pytest.raises(UsageError) as info:
            make(pattern, replacement)
        assert info.value.exit_code == 2 and info.value.argument == "replacement"
        assert f"the rule s/{pattern}/{replacement}/ cannot be applied: {said}" in str(info.value)
    # What re accepts still works, a pattern that matches no key included.
    assert regex_rule(r"(?P<n>\d+)", r"<\g<n>>").apply("a.1") == "a.<1>"
    assert regex_rule("conv", r"\g<0>2").apply("conv.w") == "conv2.w"
    assert regex_rule("nothing", r"\\").apply("a.w") == "a.w"


@pytest.mark.parametrize("helper", [add_prefix, strip_prefix])
@pytest.mark.parametrize(("prefix", "dotted"), [("module", "module."), ("", "module.")])
def test_a_wrapper_prefix_without_its_dot_is_refused(helper, prefix, dotted):
    # add_prefix(prefix="module") made 'moduleweight'; strip_prefix left '.weight'.
    sd = {"module.weight": 1, "weight": 2} if helper is strip_prefix else {"weight": 1}
    with pytest.raises(UsageError) as info:
        helper(sd, prefix=prefix)
    err = info.value
    assert err.exit_code == 2 and err.argument == "prefix"
    assert f"pass prefix={dotted!r}" in str(err) and "--" not in str(err)
    assert err.render(for_cli=True).endswith(f"pass --prefix {dotted}")
    assert helper({"module.weight": 1}, prefix="module.") in (
        {"weight": 1},
        {"module.module.weight": 1},
    )


def test_in_memory_rewrites_keep_keys_that_are_no_str() -> None:
    # As a file's rewrite keeps them (torch.load gives int keys back); re.sub took no int.
    sd = {"module.w": 1, 0: 2, ("a", 1): 3}
    assert ckpt_tools.strip_prefix(sd) == {"w": 1, 0: 2, ("a", 1): 3}
    assert ckpt_tools.add_prefix(sd, prefix="m.") == {"m.module.w": 1, 0: 2, ("a", 1): 3}
    rules = [ckpt_tools.sub_rule("module.", "")]
    assert list(ckpt_tools.rename_keys(sd, rules)) == ["w", 0, ("a", 1)]


def test_a_swap_written_as_two_rules_is_refused_with_the_way_through_a_third() -> None:
    # The second rule renames what the first made: both keys end as one; no duplicate to
    # remove, and the way that works is a third name.
    keys = ["enc.w", "dec.w"]
    swap = [sub_rule("enc.", "dec."), sub_rule("dec.", "enc.")]
    with pytest.raises(KeyCollisionError, match="to swap two names") as caught:
        plan_renames(keys, swap)
    assert "remove the duplicates" not in str(caught.value)
    through = [sub_rule("enc.", "tmp."), sub_rule("dec.", "enc."), sub_rule("tmp.", "dec.")]
    assert plan_renames(keys, through) == {"enc.w": "dec.w", "dec.w": "enc.w"}
    # Keys that were one already are duplicates, whatever the rules.
    with pytest.raises(KeyCollisionError, match="remove the duplicates first"):
        plan_renames(["module.w", "w"], [strip_rule("module.")])
