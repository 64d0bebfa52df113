"""Key rewrites for models whose children are compiled one by one (``structure.suggest``),
checked against torch: a fix is applied with the rules its command applies, and the result
must load into the target model with ``load_state_dict(strict=True)``, tensor for tensor."""

from __future__ import annotations

import shlex
from collections.abc import Callable

import pytest
import torch
from torch import nn

import ckpt_tools
from ckpt_tools.structure.keys import plan_renames, rename_keys
from ckpt_tools.structure.steps import Step, fix_command, fix_python, step_rules
from ckpt_tools.structure.suggest import (
    MAX_PATH_RULES,
    best_fix,
    check_fix,
    path_fix,
    rank_fixes,
    wrapper_partners,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 2)


class Ema(nn.Module):
    """An EMA helper keeps its copy as ``self.module``: a plain attribute, not DDP's."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 4)


class NetWithEma(Net):
    def __init__(self) -> None:
        super().__init__()
        self.ema = Ema()


class Wrapper(nn.Module):
    """What DDP and DataParallel put around a model: its keys all start with ``module.``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def compiled_children(*indices: int, ema: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = NetWithEma() if ema else Net()
        for i in indices:
            model.blocks[i] = torch.compile(model.blocks[i])
        return model

    return build


#: Each layout is a factory; with one seed, every layout holds the same numbers.
LAYOUTS: dict[str, Callable[[], nn.Module]] = {
    "plain": Net,
    "child 1 compiled": compiled_children(1),
    "children 0, 2 compiled": compiled_children(0, 2),
    "every child compiled": compiled_children(0, 1, 2),
    "whole and child 1 compiled": lambda: torch.compile(compiled_children(1)()),
    "DDP around child 1 compiled": lambda: Wrapper(compiled_children(1)()),
    "DDP, plain": lambda: Wrapper(Net()),
}

EMA_LAYOUTS: dict[str, Callable[[], nn.Module]] = {
    "plain": NetWithEma,
    "child 1 compiled": compiled_children(1, ema=True),
    "DDP around child 1 compiled": lambda: Wrapper(compiled_children(1, ema=True)()),
}


def built(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory()


def pairs(layouts: dict[str, Callable[[], nn.Module]]) -> list[tuple[str, str]]:
    return [(a, b) for a in layouts for b in layouts if a != b]


def loads_strictly(fix_rules: tuple, source: nn.Module, target: nn.Module) -> None:
    """The rewritten state dict loads into ``target`` strictly, and every tensor is the one
    it was (the layouts hold the same numbers under the same seed)."""
    target.load_state_dict(rename_keys(source.state_dict(), fix_rules), strict=True)
    got = [t for t in target.state_dict().values()]
    want = [t for t in source.state_dict().values()]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize(("have", "want"), pairs(LAYOUTS))
def test_the_best_wrapper_fix_loads_every_per_child_compile_layout(have: str, want: str) -> None:
    source, target = built(LAYOUTS[have], 0), built(LAYOUTS[want], 1)
    keys_a, keys_b = list(source.state_dict()), list(target.state_dict())
    fix = best_fix(keys_a, keys_b)
    assert fix is not None and fix.complete, (have, want, fix)
    loads_strictly(fix.rules, source, target)
    # Every fix ranked, best or not, sends each key it makes match to its own tensor.
    partners = wrapper_partners(keys_a, keys_b)
    for other in rank_fixes(keys_a, keys_b):
        plan = plan_renames(keys_a, other.rules)
        made = {old: new for old, new in plan.items() if old not in keys_b and new in keys_b}
        assert all(partners[old] == new for old, new in made.items()), other.describe()


@pytest.mark.parametrize(("have", "want"), pairs(EMA_LAYOUTS))
def test_an_ema_attribute_named_module_is_kept(have: str, want: str) -> None:
    source, target = built(EMA_LAYOUTS[have], 0), built(EMA_LAYOUTS[want], 1)
    fix = best_fix(list(source.state_dict()), list(target.state_dict()))
    assert fix is not None and fix.complete
    loads_strictly(fix.rules, source, target)
    assert not any(s.prefix.startswith("ema.") for s in fix.steps)


def test_a_rename_onto_another_childs_tensor_is_never_offered() -> None:
    # blocks.0.weight is compiled on the other side (blocks.0._orig_mod.weight): renaming it
    # to blocks.1.weight makes a name match and loads the wrong tensor.
    keys_a = list(compiled_children(1)().state_dict())
    keys_b = list(compiled_children(0, 2)().state_dict())
    assert check_fix([Step("sub", "blocks.0.", "blocks.1.")], keys_a, keys_b) is None
    texts = [fix.describe() for fix in rank_fixes(keys_a, keys_b)]
    assert texts == [
        "renaming 'blocks.0.' to 'blocks.0._orig_mod.', "
        "then renaming 'blocks.1._orig_mod.' to 'blocks.1.', "
        "then renaming 'blocks.2.' to 'blocks.2._orig_mod.'",
    ]
    assert [(f.resolved, f.unmatched) for f in rank_fixes(keys_a, keys_b)] == [(6, 6)]
    # Right for the 2 keys it claims, and left out: the fix above makes those 2 match too.
    partial = check_fix([Step("strip-inner", "_orig_mod.")], keys_a, keys_b)
    assert partial is not None and (partial.resolved, partial.unmatched) == (2, 6)


def test_a_rewrite_that_renames_a_matching_key_is_never_offered() -> None:
    # Stripping '_orig_mod.' everywhere fixes blocks.1 and breaks blocks.0, which matched.
    keys_a = list(compiled_children(0, 1)().state_dict())
    keys_b = list(compiled_children(0)().state_dict())
    assert check_fix([Step("strip-inner", "_orig_mod.")], keys_a, keys_b) is None
    fixes = rank_fixes(keys_a, keys_b)
    assert [f.describe() for f in fixes] == ["renaming 'blocks.1._orig_mod.' to 'blocks.1.'"]
    assert all(f.broken == 0 for f in fixes)


def test_nothing_is_said_where_no_rewrite_is_right() -> None:
    # The same names bare, each twice on the target side: no key has one partner, and the
    # only rewrites that make names match would pick one of two tensors by chance.
    keys_a = ["blocks.1.weight"]
    keys_b = ["blocks.1._orig_mod.weight", "blocks.1._fsdp_wrapped_module.weight"]
    assert wrapper_partners(keys_a, keys_b) == {}
    assert path_fix(keys_a, keys_b) == ()
    assert best_fix(keys_a, keys_b) is None


def test_the_command_applies_what_was_checked() -> None:
    # An add with nothing stripped is a --regex, which `ckpt rename` applies after every
    # --sub: the maps are checked, and printed, as applying first.
    keys_a = list(Net().state_dict())
    keys_b = list(Wrapper(compiled_children(1)()).state_dict())
    fix = best_fix(keys_a, keys_b)
    assert fix is not None and fix.complete
    assert fix.steps == (Step("sub", "blocks.1.", "blocks.1._orig_mod."), Step("add", "module."))
    assert fix.rules == step_rules(fix.steps)
    assert fix_command("a.pt", fix.steps, keys=keys_a) == (
        "ckpt rename a.pt a.renamed.pt --sub blocks.1.=blocks.1._orig_mod. --regex '^=module.'"
    )


def test_past_the_limit_of_path_rules_nothing_is_offered() -> None:
    n = MAX_PATH_RULES + 1
    keys_a = [f"blocks.{i}.weight" for i in range(n)]
    keys_b = [f"blocks.{i}._orig_mod.weight" for i in range(n)]
    assert path_fix(keys_a, keys_b) == ()
    assert len(path_fix(keys_a[:-1], keys_b[:-1])) == MAX_PATH_RULES


def test_a_tensor_without_the_wrapper_leaves_the_wrapped_keys_paired() -> None:
    # DDP's keys beside a `step` tensor saved with them: `module.` no longer leads every key,
    # and each wrapped key must still be sent only to its own tensor.
    model = Net()
    source = {**Wrapper(model).state_dict(), "step": torch.tensor(3)}
    keys_a, keys_b = list(source), list(Net().state_dict())
    partners = wrapper_partners(keys_a, keys_b)
    assert partners == {f"module.{k}": k for k in keys_b}
    fixes = rank_fixes(keys_a, keys_b)
    assert [(f.describe(), f.resolved, f.unmatched) for f in fixes] == [
        ("stripping 'module.'", len(keys_b), len(keys_a))
    ]
    # Every block has the shape of every other: a rename of one block onto another would
    # count as a match by shape, and loads the wrong tensor.
    wrong = [Step("sub", "module.blocks.0.", "blocks.1.")]
    assert check_fix(wrong, keys_a, keys_b) is None
    renamed = rename_keys(source, fixes[0].rules)
    assert renamed.pop("step") == 3
    target = Net()
    target.load_state_dict(renamed, strict=True)
    assert all(
        torch.equal(a, b) for a, b in zip(target.state_dict().values(), model.state_dict().values())
    )


def test_a_backslash_in_an_added_prefix_is_written_as_it_is(tmp_path) -> None:
    # re.sub reads "\x" in a replacement as an escape: the rules, the command and the call
    # write the key's backslash literally.
    from tests.helpers import run_ckpt

    keys = ["blocks.1.w", "c"]
    steps = (Step("sub", "blocks.1.", "b1."), Step("add", "pre\\x."))
    want = {"pre\\x.b1.w": 1, "pre\\x.c": 2}
    sd = dict(zip(keys, (1, 2)))
    assert rename_keys(sd, step_rules(steps)) == want
    assert eval(fix_python(steps), {"ckpt_tools": ckpt_tools, "sd": sd}) == want
    torch.save({k: torch.ones(1) for k in keys}, tmp_path / "a.pt")
    command = fix_command(str(tmp_path / "a.pt"), steps, keys=keys)
    run_ckpt(*shlex.split(command)[1:])
    assert list(torch.load(tmp_path / "a.renamed.pt", weights_only=True)) == list(want)
    torch.save({k: torch.ones(1) for k in want}, tmp_path / "b.pt")
    report = run_ckpt("diff", tmp_path / "a.renamed.pt", tmp_path / "b.pt", "--fail-on", "any")
    assert "identical" in report.stdout
