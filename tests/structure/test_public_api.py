"""Every public function follows the API's rules, so that knowing one call tells you the next.

Read from the signatures of the functions in ``ckpt_tools.__all__``:

- the inputs (``src``, ``dst``, ``srcs``, ``path`` ...) come first and positionally; every
  option is keyword-only;
- no ``**options``, and no parameter named like a builtin (``format``, ``all``, ``type`` ...);
- an option shared by several operations has one annotation and one default everywhere (the
  table below, with the types of ``ckpt_tools._types``), and any other option name means one
  type wherever it appears;
- one declared return type, whatever the arguments (no union of results).

Each check is shown failing on a small synthetic function, so the next operation added to
``__all__`` is held to the same rules.
"""

from __future__ import annotations

import builtins
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

import ckpt_tools
from ckpt_tools import RewriteResult, TransformResult, WriteResult
from ckpt_tools._types import Select, VerifyLevel

#: The names an operation's inputs (and output) take; only these come positionally.
INPUTS = frozenset(
    {
        "src",
        "dst",
        "srcs",
        "path",
        "paths",
        "a",
        "b",
        "sd",
        "model",
        "root",
        "keys",
        "base",
        "adapter",
    }
)

#: Values made of their positional parts: a rule is its two strings, and ``rename_keys``
#: applies its rules to a dict, as ``sorted(seq, key)`` might.
POSITIONAL_DATA: Mapping[str, tuple[str, ...]] = {
    "sub_rule": ("old", "new"),
    "regex_rule": ("pattern", "replacement"),
    "rename_keys": ("sd", "rules"),
}

#: Options several operations take: one annotation (as written, from ckpt_tools._types) and
#: one default wherever they appear.
SHARED: Mapping[str, tuple[str, Any]] = {
    "select": ("Select", None),
    "select_b": ("Select", None),
    "output_format": ("OutputFormat | None", None),
    "verify": ("VerifyLevel", "sizes"),
    "durable": ("bool", True),
    "dry_run": ("bool", False),
    "force": ("bool", False),
    "in_place": ("bool", False),
    "progress": ("Progress | None", None),
    "jobs": ("int", 1),
    "allow_globals": ("Sequence[str]", ()),
    "drop_extras": ("bool", False),
    "trust": ("bool", False),
    "strict": ("bool", True),
    "map_location": ("MapLocation", "auto"),
    "max_shard_size": ("str | int | None", None),
}

#: Option names whose annotation or default differs on purpose, and why.
DIFFERS: Mapping[str, str] = {
    "prefix": (
        "a key prefix: strip_module detects the ones to strip unless given one (None), "
        "add_module and the dict helpers add or strip 'module.', extract needs one"
    ),
}

_BUILTINS = frozenset(name for name in dir(builtins) if not name.startswith("_"))
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _annotation(parameter: inspect.Parameter) -> str:
    ann = parameter.annotation
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def positional_inputs_only(name: str, func: Callable[..., Any]) -> list[str]:
    """Only inputs come positionally; every option is keyword-only."""
    parameters = inspect.signature(func).parameters.values()
    problems = [
        f"{name}: *{p.name} takes options positionally"
        for p in parameters
        if p.kind is inspect.Parameter.VAR_POSITIONAL
    ]
    positional = tuple(p.name for p in parameters if p.kind in _POSITIONAL)
    if name in POSITIONAL_DATA:
        if positional != POSITIONAL_DATA[name]:
            problems.append(f"{name}: positional {positional}, expected {POSITIONAL_DATA[name]}")
        return problems
    return problems + [
        f"{name}: {option!r} is positional; make it keyword-only (after *)"
        for option in positional
        if option not in INPUTS
    ]


def no_var_keyword(name: str, func: Callable[..., Any]) -> list[str]:
    """No ``**options``: every option is named in the signature."""
    return [
        f"{name}: **{p.name} hides its options"
        for p in inspect.signature(func).parameters.values()
        if p.kind is inspect.Parameter.VAR_KEYWORD
    ]


def no_builtin_names(name: str, func: Callable[..., Any]) -> list[str]:
    """No parameter shadows a builtin (``format``, ``all``, ``type``, ``input``, ``id`` ...)."""
    return [
        f"{name}: {p.name!r} shadows a builtin"
        for p in inspect.signature(func).parameters.values()
        if p.name in _BUILTINS
    ]


def shared_options_agree(name: str, func: Callable[..., Any]) -> list[str]:
    """A shared option has its one annotation and its one default."""
    problems = []
    for p in inspect.signature(func).parameters.values():
        if p.name not in SHARED:
            continue
        want_ann, want_default = SHARED[p.name]
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"{name}: option {p.name!r} is not keyword-only")
        if _annotation(p) != want_ann:
            problems.append(f"{name}: {p.name}: {_annotation(p)}, expected {want_ann}")
        if p.default is inspect.Parameter.empty or p.default != want_default:
            shown = "required" if p.default is inspect.Parameter.empty else repr(p.default)
            problems.append(f"{name}: {p.name}={shown}, expected {want_default!r}")
    return problems


def one_return_type(name: str, func: Callable[..., Any]) -> list[str]:
    """One declared return type: not missing, not a union of what it might return."""
    ann = inspect.signature(func).return_annotation
    if ann is inspect.Signature.empty:
        return [f"{name}: no return annotation"]
    text = ann if isinstance(ann, str) else inspect.formatannotation(ann)
    if "|" in text or text.startswith(("Union[", "Optional[")):
        return [f"{name}: returns {text}; return one type whatever the arguments"]
    return []


def one_type_per_name(functions: Mapping[str, Callable[..., Any]]) -> list[str]:
    """An option name not in the table means one type (and one default) wherever it appears."""
    seen: dict[str, dict[tuple[str, str], list[str]]] = {}
    for name, func in functions.items():
        for p in inspect.signature(func).parameters.values():
            if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name in SHARED:
                continue
            default = "" if p.default is inspect.Parameter.empty else repr(p.default)
            seen.setdefault(p.name, {}).setdefault((_annotation(p), default), []).append(name)
    problems = []
    for option, forms in seen.items():
        annotations = {ann for ann, _ in forms}
        defaults = {default for _, default in forms if default}
        if option not in DIFFERS and (len(annotations) > 1 or len(defaults) > 1):
            problems.append(f"{option!r} differs across operations: {forms}")
    return problems


CHECKS = (
    positional_inputs_only,
    no_var_keyword,
    no_builtin_names,
    shared_options_agree,
    one_return_type,
)


def _public_functions() -> dict[str, Callable[..., Any]]:
    return {
        name: getattr(ckpt_tools, name)
        for name in ckpt_tools.__all__
        if inspect.isfunction(getattr(ckpt_tools, name))
    }


PUBLIC = _public_functions()


def test_the_operations_are_there() -> None:
    # The file operations named like the CLI commands, and the loaders beside them.
    commands = {
        "rewrite", "strip_module", "add_module", "rename", "retag", "convert", "slim",
        "extract", "average", "merge_lora", "reshard", "consolidate", "sanitize", "inspect",
        "scan", "diff", "load_state_dict", "load_with_info", "load_into", "list_devices",
        "pick_devices",
    }  # fmt: skip
    assert commands <= set(PUBLIC), sorted(commands - set(PUBLIC))
    assert not {"strip_module_file", "add_module_file", "rename_file"} & set(ckpt_tools.__all__)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_function_follows_the_rules(
    name: str, check: Callable[..., list[str]]
) -> None:
    assert check(name, PUBLIC[name]) == []


def test_an_option_name_means_one_type() -> None:
    assert one_type_per_name(PUBLIC) == []
    for option in DIFFERS:  # an exception that no longer differs is dropped from the table
        forms = {
            (_annotation(p), p.default)
            for func in PUBLIC.values()
            for p in inspect.signature(func).parameters.values()
            if p.name == option
        }
        assert len(forms) > 1, f"{option!r} no longer differs: drop it from DIFFERS"


def test_the_shared_table_is_used() -> None:
    # Every row of the table is an option some public function takes.
    taken = {p for func in PUBLIC.values() for p in inspect.signature(func).parameters}
    assert set(SHARED) <= taken, sorted(set(SHARED) - taken)


# --- each check fails where it should ---------------------------------------------------------


def good(
    src: str, dst: str, *, select: Select = None, verify: VerifyLevel = "sizes"
) -> WriteResult:
    """A function that follows every rule."""
    raise NotImplementedError


def option_positional(src: str, dst: str, verify: VerifyLevel = "sizes") -> WriteResult:
    raise NotImplementedError


def star_args(src: str, *rules: str) -> WriteResult:
    raise NotImplementedError


def options_hidden(src: str, dst: str, **options: Any) -> WriteResult:
    raise NotImplementedError


def builtin_named(src: str, dst: str, *, format: str | None = None) -> WriteResult:
    raise NotImplementedError


def select_narrowed(src: str, *, select: str | None = None) -> WriteResult:
    raise NotImplementedError


def verify_untyped(src: str, *, verify: str = "sizes") -> WriteResult:
    raise NotImplementedError


def durable_default(src: str, *, durable: bool = False) -> WriteResult:
    raise NotImplementedError


def two_results(src: str, dst: str) -> RewriteResult | TransformResult:
    raise NotImplementedError


def unannotated(src: str, dst: str):
    raise NotImplementedError


@pytest.mark.parametrize(
    ("func", "check", "said"),
    [
        (option_positional, positional_inputs_only, "'verify' is positional"),
        (star_args, positional_inputs_only, "*rules takes options positionally"),
        (options_hidden, no_var_keyword, "**options hides its options"),
        (builtin_named, no_builtin_names, "'format' shadows a builtin"),
        (select_narrowed, shared_options_agree, "select: str | None, expected Select"),
        (verify_untyped, shared_options_agree, "verify: str, expected VerifyLevel"),
        (durable_default, shared_options_agree, "durable=False, expected True"),
        (two_results, one_return_type, "returns RewriteResult | TransformResult"),
        (unannotated, one_return_type, "no return annotation"),
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_each_check_fails_on_a_function_that_breaks_its_rule(
    func: Callable[..., Any], check: Callable[..., list[str]], said: str
) -> None:
    problems = check(func.__name__, func)
    assert len(problems) == 1 and said in problems[0], problems
    assert all(c(good.__name__, good) == [] for c in CHECKS)


def _sharded(src: str, dst: str, *, limit: int = 5) -> WriteResult:
    raise NotImplementedError


def _sharded_other(src: str, dst: str, *, limit: str = "5GB") -> WriteResult:
    raise NotImplementedError


def _sharded_later(src: str, dst: str, *, limit: int = 10) -> WriteResult:
    raise NotImplementedError


@pytest.mark.parametrize(
    ("other", "said"),
    [(_sharded_other, "'limit' differs"), (_sharded_later, "'limit' differs")],
    ids=["another-type", "another-default"],
)
def test_one_type_per_name_fails_where_an_option_changes_meaning(
    other: Callable[..., Any], said: str
) -> None:
    assert one_type_per_name({"first": _sharded, "again": _sharded}) == []
    problems = one_type_per_name({"first": _sharded, "second": other})
    assert len(problems) == 1 and said in problems[0], problems


def test_positional_data_must_match_its_row() -> None:
    def rename_keys(sd: dict, *, rules: Sequence[str]) -> dict:
        raise NotImplementedError

    assert positional_inputs_only("rename_keys", rename_keys) == [
        "rename_keys: positional ('sd',), expected ('sd', 'rules')"
    ]


def test_every_error_class_is_exported_and_the_type_aliases_are_types() -> None:
    # ``except ct.MissingExtraError`` must work as every other error of the tree does.
    from ckpt_tools import errors

    tree = {
        name
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, errors.CheckpointError)
    }
    assert sorted(tree - set(ckpt_tools.__all__)) == []
    assert ckpt_tools.MissingExtraError is errors.MissingExtraError
    # The aliases of ckpt_tools._types are exported as types, never checked as functions
    # (inspect.signature of one raises).
    aliases = {"MapLocation", "OutputFormat", "Progress", "Select", "StrPath", "VerifyLevel"}
    assert aliases <= set(ckpt_tools.__all__) and not aliases & set(PUBLIC)
