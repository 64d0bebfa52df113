"""How dangerous each global a pickle imports is: a table, each entry with its reason.

Three severities:

- ``allowed``: on torch's ``weights_only`` allowlist (what our reader resolves itself).
- ``nonstandard``: a known data type outside that allowlist (numpy arrays, ``argparse``
  namespaces, OmegaConf containers, paths, the classes of a pickled ``nn.Module``): loading
  it needs ``weights_only=False``, but it runs no code of its own choosing.
  ``ckpt sanitize`` turns such a file into a plain one.
- ``dangerous``: can run code or touch the system (``os``, ``subprocess``, ``eval``, torch
  functions that load, compile or call), and every global the table does not know: an
  unknown class is imported, then called or given its state, which is code.

A rule naming the global itself decides first; then families (``fnmatch`` patterns, ``*``
matching dots too) in order. The families of classes (``torch.nn``, ``torch.optim``, numpy's
generators) take names that start in upper case only: a module-level function there is
judged as unknown. A family admits a name only where its spelling can be one of its own
members: never a special attribute (``__builtins__``, ``__dict__``), a module alias
(``torch.nn.modules.linear.F`` is ``torch.nn.functional``), a builtin's name, or a gadget
re-exported there (``torch.nn.attention._fa3.Library``). A global imported by an
attribute path (a dotted name, which the unpickler follows attribute by attribute) is judged
by exact names only, or by a family that makes it dangerous.
"""

from __future__ import annotations

import builtins
import fnmatch
import functools
from typing import Literal

from ckpt_tools.dtypes import BY_NAME_STORAGE_TYPES
from ckpt_tools.formats.dcp.globals import DCP_METADATA_GLOBALS, ENUM_GETATTR
from ckpt_tools.formats.pickle.allowlist import ALLOWED_GLOBALS
from ckpt_tools.formats.pickle.imports import PickleImport
from ckpt_tools.ops.scan.rules import RULES, Rule, Severity

__all__ = [
    "RULES",
    "Context",
    "Rule",
    "Severity",
    "classify",
    "could_import",
    "known_danger",
    "storage_class_rule",
]

#: Where a pickle lies: a plain pickle or checkpoint, a TorchScript archive's, or a DCP
#: folder's ``.metadata`` (whose classes DCP reads as data); ``dcp-metadata-read`` is one
#: our reader read, so each ``getattr`` call in it was one it admits
#: (:class:`~ckpt_tools.formats.dcp.globals.EnumByName`: an enum member by name).
Context = Literal["pickle", "torchscript", "dcp-metadata", "dcp-metadata-read"]
SEVERITIES: tuple[Severity, ...] = ("allowed", "nonstandard", "dangerous")


# In a TorchScript archive, torch.jit.load resolves classes from the archive's own code/
# (TorchScript, compiled by torch), not by importing Python modules.
_TORCHSCRIPT = (
    Rule("__torch__.*", "nonstandard", "a TorchScript class, defined in the archive's code/"),
    Rule("torch.jit._pickle.*", "nonstandard", "TorchScript's own pickle helpers"),
)
_UNREAD = Rule(
    "<bytes not read>",
    "dangerous",
    "bytes a loader unpickles that the scan cannot read (placed by a call it does not run, "
    "compressed otherwise than by deflate, or past the part of a record it walks)",
)
_UNKNOWN = Rule(
    "*",
    "dangerous",
    "not in the table: loading imports its module and calls or builds it, which can run code",
)


_PATH = Rule(
    "",
    "dangerous",
    "an attribute path: the unpickler follows it attribute by attribute from the module, "
    "which reaches any object the module can reach",
)
_DUNDER = Rule(
    "*.__*__*",
    "dangerous",
    "names a special attribute (a module's __builtins__ or __dict__, a function's "
    "__globals__), which reaches any object the module can reach",
)
_ALIAS = Rule(
    "",
    "dangerous",
    "spelled like a family the table admits, but that name is bound there to a module, "
    "a function or a re-export from elsewhere, not to one of the family's own classes",
)

# Names torch's modules bind to something other than the family's own classes: module
# aliases (F is torch.nn.functional), re-exports of torch's gadgets (Library,
# RemovableHandle), typing helpers, constants. torch.save names a class by the module that
# defines it, so a real pickle never spells these; the lists hold torch 2.x's, and a single
# letter is refused whatever it is.
_TYPING = (
    "ABC Any Callable Enum Generic Hashable IntEnum Iterable Iterator Literal Mapping "
    "MutableMapping NamedTuple Never NotRequired Optional OrderedDict ParamSpec Protocol "
    "Self Sequence Size Tensor TypeAlias TypeIs TypeVar TypeVarTuple TypedDict Union Unpack "
    "TYPE_CHECKING Counter SupportsFloat "
)
_NOT_IN_FAMILY: dict[str, frozenset[str]] = {
    pattern: frozenset(names.split())
    for pattern, names in (
        (
            "torch.nn.*.[A-Z]*",
            _TYPING + "BackwardHook BroadcastingList1 BroadcastingList2 BroadcastingList3 "
            "ConvT DType DeviceLikeType ExceptionWrapper Function "
            "GRID_SAMPLE_INTERPOLATION_MODES GRID_SAMPLE_PADDING_MODES GetAttrKey "
            "HANDLED_FUNCTIONS Join JoinHook Joinable Library LinearT OpaqueBase RPC_AVAILABLE "
            "RRef ReduceOp RemovableHandle SDPAParams THRESHOLD T_module TreeSpec Ts Variable "
            "WARN_FOR_UNFUSED_KERNELS",
        ),
        (
            "torch.nn.functional.*",
            "boolean_dispatch handle_torch_function has_torch_function "
            "has_torch_function_unary has_torch_function_variadic dataclasses grad importlib "
            "math np torch warnings reproducibility_notes sparse_support_notes tf32_notes",
        ),
        (
            "torch.optim.*.[A-Z]*",
            _TYPING + "Args DEFAULT_A DEFAULT_B DEFAULT_C DEFAULT_NS_STEPS DeviceDict "
            "DeviceDtypeDict EPOCH_DEPRECATION_WARNING EPS GlobalOptimizerPostHook "
            "GlobalOptimizerPreHook Indices Kwargs Module PARAM_LIST ParamsT RemovableHandle "
            "StateDict TensorListList",
        ),
        ("torch.amp.*.[A-Z]*", _TYPING + "HAS_NUMPY"),
    )
}
_BUILTINS = frozenset(dir(builtins))


def _is_dunder(part: str) -> bool:
    return len(part) > 4 and part.startswith("__") and part.endswith("__")


def _family_member(rule: Rule, qualname: str) -> bool:
    """Whether ``qualname``, matched by the family ``rule``, can be one of its members by
    its spelling: its last part no module alias or re-export the family's modules bind
    (torch is never imported here), and of a family of functions no private name."""
    denied = _NOT_IN_FAMILY.get(rule.pattern)
    if denied is None:
        return True
    last = qualname.rpartition(".")[2]
    private = rule.pattern.endswith(".*") and last.startswith("_")
    named = last in denied or last in _BUILTINS  # (a BUILD can copy eval into a module)
    return len(last) > 1 and not named and last.isidentifier() and not private


# The pickles torch.load reads through its own find_class, which takes any global named like
# a typed storage class (in whatever module) for that class and never imports the module:
# a zip's data.pkl, a legacy file's main pickle, a tar file's pickle member.
_STORAGE_BY_NAME = ("main pickle", "pickle")


def storage_class_rule(qualname: str, name: str | None, record: str) -> Rule | None:
    """The rule for a global named like a typed storage class outside ``torch`` (``x.FloatStorage``)
    in a pickle torch.load resolves such names in; None for any other.

    Example:
        >>> storage_class_rule("foo.HalfStorage", "HalfStorage", "archive/data.pkl").severity
        'nonstandard'
        >>> storage_class_rule("foo.HalfStorage", "HalfStorage", "notes.pkl") is None
        True
        >>> storage_class_rule("foo.UntypedStorage", "UntypedStorage", "archive/data.pkl") is None
        True
    """
    # x.UntypedStorage is none of them: imported from x, it is judged as any import.
    if name not in BY_NAME_STORAGE_TYPES or qualname == f"torch.{name}":
        return None
    if not (record.endswith("/data.pkl") or record in _STORAGE_BY_NAME):
        return None
    return Rule(
        qualname,
        "nonstandard",
        f"torch.load reads it as torch.{name} by its name, never importing its module; "
        "torch.load(weights_only=True) refuses it",
    )


@functools.lru_cache(maxsize=4096)
def classify(qualname: str, context: Context = "pickle", *, exact: bool = False) -> Rule:
    """The rule that decides ``qualname``'s severity where a pickle of ``context`` imports it.

    Args:
        qualname: ``module.name`` as Python 3 resolves it (``posix.system``), or a
            description in angle brackets for a global the pickle computes.
        context: where the pickle lies.
        exact: judge only by the table's exact names, not its families: for a name that is
            an attribute path (``torch.nn.functional`` + ``torch.serialization.os.system``,
            which a family would take for a class of ``torch.nn``), or one whose split into
            module and name is not known.

    Returns:
        The first matching :class:`Rule`; unknown and computed globals are dangerous.

    Example:
        >>> classify("posix.system").severity, classify("numpy.ndarray").severity
        ('dangerous', 'nonstandard')
        >>> classify("torch._utils._rebuild_tensor_v2").severity
        'allowed'
        >>> classify("mypackage.Net").reason
        'not in the table: loading imports its module and calls or builds it, which can run code'
    """
    if qualname in ALLOWED_GLOBALS:
        return Rule(qualname, "allowed", "on torch's weights_only allowlist")
    if context in ("dcp-metadata", "dcp-metadata-read") and qualname in DCP_METADATA_GLOBALS:
        return Rule(qualname, "allowed", "a DCP metadata class (read as data)")
    if context == "dcp-metadata-read" and qualname == ENUM_GETATTR:
        return Rule(qualname, "allowed", "names a DCP enum member (as Python 3.11.0-3.11.4 do)")
    rules = (*_TORCHSCRIPT, *RULES) if context == "torchscript" else RULES
    named = next((rule for rule in (*rules, _UNREAD) if rule.pattern == qualname), None)
    if named is not None:  # an entry for the name itself comes before any family
        return named
    if any(map(_is_dunder, qualname.split(".")[1:])):
        return _DUNDER
    family = next((r for r in rules if fnmatch.fnmatchcase(qualname, r.pattern)), _UNKNOWN)
    if exact:  # a family that makes it dangerous says why; no family admits it
        return family if family.severity == "dangerous" and family is not _UNKNOWN else _PATH
    return family if _family_member(family, qualname) else _ALIAS


def could_import(found: PickleImport) -> bool:
    """Whether a loader could import ``found``: its module and name are dotted Python names
    (or computed: unknown). Text that reads as a pickle names junk (``(in-package :cl)``: an
    INST of ``n-package :cl``), which ``pickle.load`` fails to import, running nothing.

    Example:
        >>> could_import(PickleImport("posix", "system", 0, "GLOBAL"))
        True
        >>> could_import(PickleImport("n-package :cl-user)", "x", 0, "INST"))
        False
    """
    names = (found.module, found.name)
    return any(n is None for n in names) or all(
        part.isidentifier() for n in names for part in str(n).split(".")
    )


def known_danger(qualname: str) -> bool:
    """Whether the table itself makes ``qualname`` dangerous, not only its fallback for names
    it does not know: ``subprocess.Popen`` is a known danger, a user's ``mypkg.Mode`` is not.

    Example:
        >>> known_danger("subprocess.Popen"), known_danger("mypkg.Mode")
        (True, False)
    """
    rule = classify(qualname)
    return rule.severity == "dangerous" and rule is not _UNKNOWN
