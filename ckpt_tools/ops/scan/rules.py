"""The table of globals a pickle may import, each with its severity and the reason for it.

:func:`~ckpt_tools.ops.scan.severity.classify` reads it: a rule naming the global itself
decides first, then families (``fnmatch`` patterns) in order. See
:mod:`~ckpt_tools.ops.scan.severity` for what each severity means.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

__all__ = ["RULES", "Rule", "Severity"]

Severity = Literal["allowed", "nonstandard", "dangerous"]


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
            "numpy.ma.core.MaskedArray", "numpy.ma.MaskedArray",
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
