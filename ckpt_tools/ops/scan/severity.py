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
from typing import Literal, NamedTuple

from ckpt_tools.dtypes import STORAGE_TYPE_DTYPE
from ckpt_tools.formats.dcp.globals import DCP_METADATA_GLOBALS, ENUM_GETATTR
from ckpt_tools.formats.pickle.allowlist import ALLOWED_GLOBALS

__all__ = [
    "RULES",
    "Context",
    "Rule",
    "Severity",
    "classify",
    "known_danger",
    "storage_class_rule",
]

Severity = Literal["allowed", "nonstandard", "dangerous"]
#: Where a pickle lies: a plain pickle or checkpoint, a TorchScript archive's, or a DCP
#: folder's ``.metadata`` (whose classes DCP reads as data); ``dcp-metadata-read`` is one
#: our reader read, so each ``getattr`` call in it was one it admits
#: (:class:`~ckpt_tools.formats.dcp.globals.EnumByName`: an enum member by name).
Context = Literal["pickle", "torchscript", "dcp-metadata", "dcp-metadata-read"]
SEVERITIES: tuple[Severity, ...] = ("allowed", "nonstandard", "dangerous")


class Rule(NamedTuple):
    """One row of the table: a pattern over qualified names, its severity, and why."""

    pattern: str
    severity: Severity
    reason: str


_RUNS = "runs commands or code, or touches files, processes or the network"
_CALLS = "calls or reaches any function it is given (a gadget for the others)"
_LOADS = "loads, compiles or runs code or another pickle"

RULES: tuple[Rule, ...] = (
    # Code, processes, files, the network.
    *(
        Rule(p, "dangerous", _RUNS)
        for p in (
            "os.*", "posix.*", "nt.*", "subprocess.*", "pty.*", "commands.*", "popen2.*",
            "shutil.*", "sys.*", "socket.*", "ssl.*", "select.*", "signal.*", "ctypes.*",
            "_ctypes.*", "multiprocessing.*", "_posixsubprocess.*", "threading.*", "_thread.*",
            "asyncio.*", "webbrowser.*", "urllib.*", "urllib2.*", "http.*", "httplib.*",
            "ftplib.*", "smtplib.*", "telnetlib.*", "requests.*", "aiohttp.*", "io.*",
            "_io.*", "tempfile.*", "glob.*", "zipfile.*", "tarfile.*", "pip.*", "setuptools.*",
            "distutils.*", "venv.*", "ensurepip.*", "logging.*", "platform.*", "resource.*",
        )
    ),
    *(
        Rule(p, "dangerous", _LOADS)
        for p in (
            "builtins.eval", "builtins.exec", "builtins.compile", "builtins.__import__",
            "builtins.open", "builtins.input", "builtins.breakpoint", "builtins.help",
            "builtins.exit", "builtins.quit", "runpy.*", "importlib.*", "imp.*", "pkgutil.*",
            "zipimport.*", "pickle.*", "_pickle.*", "cPickle.*", "dill.*", "cloudpickle.*",
            "joblib.*", "marshal.*", "types.*", "code.*", "codeop.*", "pdb.*", "bdb.*",
            "trace.*", "timeit.*", "cProfile.*", "profile.*", "doctest.*", "unittest.*",
            "pydoc.*", "idlelib.*", "lib2to3.*", "numpy.load", "numpy.loads",
            "numpy.lib.npyio.*", "numpy.lib.format.*", "numpy.testing.*", "numpy.f2py.*",
            "numpy.distutils.*", "numpy.ctypeslib.*",
        )
    ),
    *(
        Rule(p, "dangerous", _CALLS)
        for p in (
            "builtins.getattr", "builtins.setattr", "builtins.delattr", "builtins.globals",
            "builtins.locals", "builtins.vars", "builtins.dir", "builtins.apply",
            "builtins.map", "builtins.filter", "builtins.staticmethod",
            "builtins.classmethod", "builtins.property", "builtins.super", "builtins.type",
            "operator.*", "_operator.*", "functools.*", "_functools.*", "itertools.*",
            "contextlib.*", "weakref.*", "inspect.*", "ast.*", "dis.*",
        )
    ),
    # torch's own gadgets: loading, compiling, JIT, hub, packages, ops and extensions.
    *(
        Rule(p, "dangerous", f"torch: {_LOADS}")
        for p in (
            "torch.load", "torch.serialization.*", "torch.storage._load_from_bytes",
            "torch.jit.*", "torch._C.*", "torch.hub.*", "torch.package.*", "torch.compile",
            "torch._dynamo.*", "torch._inductor.*", "torch._functorch.*", "torch.fx.*",
            "torch.export.*", "torch._export.*", "torch.utils.cpp_extension.*",
            "torch.utils._config_module.*", "torch.utils.data.*", "torch.utils.hooks.*",
            "torch.ops.*", "torch._ops.*", "torch.library.*", "torch._library.*",
            "torch.classes.*", "torch._classes.*", "torch.distributed.*", "torch.multiprocessing.*",
            "torch.backends.*", "torch.cuda.*", "torch._utils._import_dotted_name",
            "torch.autograd.*", "torch.overrides.*", "torch.testing.*", "torch._higher_order_ops.*",
        )
    ),
    # Known data types that torch's weights_only unpickler does not admit.
    *(
        Rule(p, "nonstandard", "a numpy array, scalar or dtype (numpy builds it from bytes)")
        for p in (
            "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct",
            "numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "numpy.ndarray",
            "numpy.dtype", "numpy.dtypes.*DType", "numpy.core.numeric._frombuffer",
            "numpy._core.numeric._frombuffer", "numpy.ma.core._mareconstruct",
            "numpy.ma.core.MaskedArray",
        )
    ),
    Rule(
        "numpy.random._pickle.__*_ctor",
        "nonstandard",
        "numpy's random generator state (rebuilds a generator of numpy's own)",
    ),
    Rule("numpy.random._*.[A-Z]*", "nonstandard", "numpy's random generator classes"),
    *(
        Rule(p, "nonstandard", "numpy's random generator state")
        for p in (
            "numpy.random.bit_generator.SeedSequence",
            "numpy.random.bit_generator.__pyx_unpickle_SeedSequence",
        )
    ),
    Rule("types.SimpleNamespace", "nonstandard", "a plain namespace of values"),
    Rule("torch._C.Generator", "nonstandard", "a torch random generator's state"),
    Rule("torch.cuda.amp.grad_scaler.GradScaler", "nonstandard", "a pickled gradient scaler"),
    Rule("argparse.Namespace", "nonstandard", "hyperparameters as an argparse.Namespace"),
    *(
        Rule(p, "nonstandard", "an OmegaConf / Hydra config container")
        for p in (
            "omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig",
            "omegaconf.base.ContainerMetadata", "omegaconf.base.Metadata", "omegaconf.nodes.*",
        )
    ),
    Rule("typing.Any", "nonstandard", "a type annotation (OmegaConf stores them)"),
    *(
        Rule(p, "nonstandard", "rebuilds an object of the class it is given (judged on its own)")
        for p in ("copyreg._reconstructor", "copyreg.__newobj__", "copyreg.__newobj_ex__")
    ),
    *(
        Rule(f"pathlib.{c}", "nonstandard", "a file system path (a value, nothing is opened)")
        # (Python 3.13 pickles paths from pathlib._local.)
        for c in (
            "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
            "_local.PosixPath", "_local.WindowsPath",
        )
    ),
    *(
        Rule(p, "nonstandard", "a standard library data type")
        for p in (
            "collections.defaultdict", "collections.deque", "datetime.datetime", "datetime.date",
            "datetime.time", "datetime.timedelta", "datetime.timezone", "decimal.Decimal",
            "fractions.Fraction", "uuid.UUID", "enum.Enum", "re._compile", "builtins.dict",
            "builtins.list", "builtins.tuple", "builtins.frozenset", "builtins.int",
            "builtins.float", "builtins.str", "builtins.bytes", "builtins.bool", "builtins.slice",
            "builtins.range", "builtins.object", "builtins.NotImplemented", "builtins.Ellipsis",
        )
    ),
    Rule(
        "torch._utils._rebuild_*",
        "nonstandard",
        "a torch tensor rebuild function outside torch's weights_only allowlist",
    ),
    *(
        Rule(p, "nonstandard", "a torch data type or constant")
        for p in (
            "torch.strided", "torch.sparse_*", "torch.*_format", "torch.Generator",
            "torch.nn.parameter.Buffer", "torch.nn.parameter.UninitializedParameter",
            "torch.storage.*Storage", "torch.finfo", "torch.iinfo", "torch.dtype",
        )
    ),
    Rule(
        "torch.nn.*.[A-Z]*",
        "nonstandard",
        "a class of a pickled nn.Module (torch's own; the model's own classes are not)",
    ),
    Rule(
        "torch.nn.functional.*",
        "nonstandard",
        "a torch.nn.functional function a pickled module holds (tensor arithmetic)",
    ),
    # torch.nn.functional binds these to torch._C._nn's own (F.gelu is torch._C._nn.gelu),
    # so torch.save names them there: TransformerEncoderLayer(activation="gelu") holds one.
    *(
        Rule(f"torch._C._nn.{name}", "nonstandard", "a torch.nn.functional function a "
             "pickled module holds (its C implementation; tensor arithmetic)")
        for name in (
            "avg_pool2d", "avg_pool3d", "elu_", "gelu", "hardtanh_", "leaky_relu_", "linear",
            "log_sigmoid", "one_hot", "scaled_dot_product_attention", "softplus", "softshrink",
        )
    ),
    # What a pickled module keeps its hooks in (spectral_norm's, weight_norm's): building one
    # only stores its state and weak references; the hook it holds is judged on its own.
    Rule(
        "torch.nn.modules.module._WrappedHook",
        "nonstandard",
        "a pickled module's hook wrapper (the hook it holds is judged on its own)",
    ),
    Rule(
        "torch.utils.hooks.RemovableHandle",
        "nonstandard",
        "a pickled module's hook handle (weak references to its hook tables)",
    ),
    Rule("torch.optim.*.[A-Z]*", "nonstandard", "a pickled optimizer or learning-rate scheduler"),
    # Optimizers whose class says it is torch.optim's own (torch.save names them so).
    *(
        Rule(f"torch.optim.{name}", "nonstandard", "a pickled optimizer")
        for name in ("Adafactor", "Muon")
    ),
    Rule("torch.amp.*.[A-Z]*", "nonstandard", "a pickled gradient scaler"),
    Rule(
        "torch.amp.grad_scaler._refresh_per_optimizer_state",
        "nonstandard",
        "a gradient scaler's default-state factory (returns a fresh dict)",
    ),
)  # fmt: skip

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
    """
    if name not in STORAGE_TYPE_DTYPE or qualname == f"torch.{name}":
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


def known_danger(qualname: str) -> bool:
    """Whether the table itself makes ``qualname`` dangerous, not only its fallback for names
    it does not know: ``subprocess.Popen`` is a known danger, a user's ``mypkg.Mode`` is not.

    Example:
        >>> known_danger("subprocess.Popen"), known_danger("mypkg.Mode")
        (True, False)
    """
    rule = classify(qualname)
    return rule.severity == "dangerous" and rule is not _UNKNOWN
