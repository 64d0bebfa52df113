"""The severity table: torch's own weights_only allowlist is the oracle for ``allowed``,
and each family of gadget is dangerous wherever it is named."""

from __future__ import annotations

import json

import pytest

from ckpt_tools.formats.dcp.globals import DCP_METADATA_GLOBALS
from ckpt_tools.formats.pickle.allowlist import ALLOWED_GLOBALS
from ckpt_tools.ops.scan.severity import RULES, SEVERITIES, classify
from tests.helpers.child_oracle import run_script, torchs_allowlists


def test_allowed_is_exactly_torchs_weights_only_allowlist() -> None:
    # As ``import torch`` leaves it, in a fresh process: other tests import more of torch
    # (torch.distributed.tensor adds its own globals when imported). Then as ``import
    # torch._dynamo`` leaves it, which loading a jagged tensor saved by nested_tensor needs:
    # of what that adds, only its _DimRange is allowed (not the DTensor classes).
    fresh, dynamo = torchs_allowlists()
    theirs = fresh | {"torch._dynamo.decorators._DimRange"}
    assert theirs <= dynamo
    assert {name for name in theirs if classify(name).severity != "allowed"} == set()
    assert {n for n in dynamo - theirs if classify(n).severity == "allowed"} == set()
    # Nothing else is allowed outside a DCP folder's metadata: the table's families are not.
    candidates = ALLOWED_GLOBALS | {r.pattern for r in RULES if "*" not in r.pattern}
    assert {n for n in candidates if classify(n).severity == "allowed"} <= theirs


def test_every_rule_says_why() -> None:
    assert all(r.severity in SEVERITIES and len(r.reason) > 10 for r in RULES)
    patterns = [r.pattern for r in RULES]
    assert len(patterns) == len(set(patterns))


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "posix.system",
        "nt.system",
        "subprocess.Popen",
        "builtins.eval",
        "builtins.exec",
        "builtins.getattr",
        "builtins.__import__",
        "operator.attrgetter",
        "functools.partial",
        "runpy._run_code",
        "importlib.import_module",
        "pickle.loads",
        "torch.load",
        "torch.storage._load_from_bytes",
        "torch.serialization.load",
        "torch.jit.load",
        "torch.hub.load",
        "torch._ops.ops",
        "torch.fx.graph_module.reduce_graph_module",
        "torch.utils.cpp_extension.load_inline",
        "numpy.load",
        "numpy.testing._private.utils.runstring",
        "pathlib.Path.write_text",
        # Families of classes take class names only: a function at module level is unknown.
        "torch.nn.modules.module.register_module_forward_hook",
        "torch.optim.optimizer.register_optimizer_step_pre_hook",
        "torch.utils.hooks.BackwardHook",
        "torch.utils.hooks.unserializable_hook",
        "numpy.random._pickle.helper",
        # Of torch._C._nn, only the functions torch.nn.functional binds.
        "torch._C._nn._parse_to",
        "torch._C._nn.gelu.__globals__",
        "__main__.Net",
        "mypackage.models.Net",
        "<computed global>",
        "<copyreg extension code>",
    ],
)
def test_gadgets_and_unknown_globals_are_dangerous(name: str) -> None:
    assert classify(name).severity == "dangerous"
    assert classify(name, "torchscript").severity == "dangerous" or name.startswith("torch.jit")


@pytest.mark.parametrize(
    "name",
    [
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray.scalar",
        "numpy.dtype",
        "numpy.dtypes.Float32DType",
        "argparse.Namespace",
        "omegaconf.dictconfig.DictConfig",
        "omegaconf.nodes.AnyNode",
        "typing.Any",
        "pathlib.PosixPath",
        "collections.defaultdict",
        "builtins.int",
        "copyreg._reconstructor",
        "torch.nn.modules.linear.Linear",
        "torch.nn.functional.gelu",
        "torch._C._nn.gelu",
        "torch._C._nn.scaled_dot_product_attention",
        "torch.optim.adam.Adam",
        "torch.optim.lr_scheduler.OneCycleLR",
        "torch.amp.grad_scaler.GradScaler",
        "torch.nn.modules.module._WrappedHook",
        "torch.utils.hooks.RemovableHandle",
        "numpy.random._mt19937.MT19937",
    ],
)
def test_known_data_types_are_nonstandard(name: str) -> None:
    assert classify(name).severity == "nonstandard"


def test_torch_c_nn_functions_are_those_torch_nn_functional_binds() -> None:
    """torch.save names F.gelu torch._C._nn.gelu: exactly those names are nonstandard."""
    import pickle
    import pickletools

    import torch.nn.functional as F

    named = set()
    for attr in dir(F):
        fn = getattr(F, attr)
        if isinstance(fn, type) or not callable(fn):
            continue
        try:
            data = pickle.dumps(fn, protocol=2)
        except (pickle.PicklingError, TypeError, AttributeError):
            continue  # a typing helper or a local function: never in a saved module
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL" and arg.startswith("torch._C._nn "):
                named.add(arg.replace(" ", "."))
    ours = {r.pattern for r in RULES if r.pattern.startswith("torch._C._nn.")}
    assert named == ours
    assert {classify(name).severity for name in named} == {"nonstandard"}


# The name torch.save gives each public class of torch.nn, torch.optim and torch.amp that a
# pickled model, optimizer, scheduler or scaler is made of (its __module__ and __qualname__).
# Run in a child: importing every submodule imports torch._dynamo, which changes what
# torch.load(weights_only=True) admits in this process.
_SAVED_CLASS_NAMES = """
import importlib, inspect, json, pkgutil, warnings
import torch
warnings.simplefilter("ignore")  # deprecated modules say so on import
bases = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
         torch.amp.GradScaler)
saved = set()
for root in ("torch.nn", "torch.optim", "torch.amp"):
    package = importlib.import_module(root)
    for name in [root] + [m.name for m in pkgutil.walk_packages(package.__path__, root + ".")]:
        if any(part in name for part in (".quantized", ".qat", ".intrinsic")):
            continue  # re-exports of torch.ao's quantization modules
        for cls in vars(importlib.import_module(name)).values():
            qualname = f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}"
            if (inspect.isclass(cls) and issubclass(cls, bases) and qualname.startswith(root)
                    and not any(p.startswith("_") for p in qualname.split("."))):
                saved.add(qualname)
print(json.dumps(sorted(saved)))
"""


def test_every_public_class_of_torch_nn_and_optim_is_nonstandard_by_its_saved_name() -> None:
    saved = json.loads(run_script(_SAVED_CLASS_NAMES, check=True)[-1])
    assert {"torch.optim.Adafactor", "torch.nn.modules.linear.Linear"} <= set(saved)
    assert [q for q in saved if classify(q).severity != "nonstandard"] == []


def test_a_saved_transformer_layer_with_gelu_is_nonstandard(tmp_path) -> None:
    import torch

    from ckpt_tools import scan

    path = tmp_path / "layer.pt"
    torch.save(torch.nn.TransformerEncoderLayer(8, 2, 16, activation="gelu"), path)
    (found,) = scan(path).files
    assert found.verdict == "nonstandard"
    assert "torch._C._nn.gelu" in {f.global_name for f in found.findings}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # weight_norm is deprecated
def test_saved_modules_with_hooks_are_nonstandard_but_a_bound_method_is_not(tmp_path) -> None:
    import torch

    from ckpt_tools import scan

    normed = tmp_path / "normed.pt"
    linear = torch.nn.Linear(4, 4)
    torch.save(
        torch.nn.Sequential(
            torch.nn.utils.spectral_norm(linear), torch.nn.utils.weight_norm(torch.nn.Linear(4, 4))
        ),
        normed,
    )
    (found,) = scan(normed).files
    assert found.verdict == "nonstandard", found.findings
    assert "torch.nn.modules.module._WrappedHook" in {f.global_name for f in found.findings}

    # A lazy module's hooks are its own bound methods, which pickle as builtins.getattr.
    lazy = tmp_path / "lazy.pt"
    torch.save(torch.nn.LazyLinear(3), lazy)
    (found,) = scan(lazy).files
    severity = {f.global_name: f.severity for f in found.findings}
    assert severity["torch.utils.hooks.RemovableHandle"] == "nonstandard"
    assert severity["builtins.getattr"] == found.verdict == "dangerous"


def test_context_decides_torchscript_classes_and_dcp_metadata() -> None:
    assert classify("__torch__.TinyNet").severity == "dangerous"
    assert classify("__torch__.TinyNet", "torchscript").severity == "nonstandard"
    assert classify("torch.jit._pickle.build_intlist", "torchscript").severity == "nonstandard"
    for name in DCP_METADATA_GLOBALS:
        assert classify(name, "dcp-metadata").severity == "allowed"
        outside = classify(name).severity
        assert outside == ("nonstandard" if name.startswith("pathlib.") else "dangerous")
        assert classify(name, "dcp-metadata-read").severity == "allowed"
    # getattr only in a .metadata our reader read (each call the by-name form of an enum member).
    assert classify("builtins.getattr", "dcp-metadata-read").severity == "allowed"
    for context in ("pickle", "torchscript", "dcp-metadata"):
        assert classify("builtins.getattr", context).severity == "dangerous"  # type: ignore[arg-type]


def test_a_storage_class_in_another_module_is_read_by_its_name(tmp_path) -> None:
    """torch.load takes ``any_module.FloatStorage`` in data.pkl for torch.FloatStorage and
    never imports the module: nonstandard (weights_only refuses it), not dangerous; a plain
    pickle's unpickler imports the module, so there it stays dangerous."""
    import io
    import pickle
    import zipfile

    import torch

    from ckpt_tools import scan

    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    path = tmp_path / "renamed.pt"
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name in src.namelist():
            data = src.read(name)
            if name.endswith("/data.pkl"):
                data = data.replace(b"ctorch\nFloatStorage\n", b"cnot_a_module\nFloatStorage\n")
            out.writestr(name, data)
    assert torch.equal(torch.load(path, weights_only=False)["w"], torch.ones(3))  # the oracle
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    found = scan([path]).files[0]
    assert found.verdict == "nonstandard"
    assert [(f.global_name, f.severity) for f in found.findings] == [
        ("not_a_module.FloatStorage", "nonstandard")
    ]
    (tmp_path / "plain.pkl").write_bytes(b"\x80\x02cnot_a_module\nFloatStorage\n.")
    assert scan([tmp_path / "plain.pkl"]).files[0].verdict == "dangerous"


def test_untyped_storage_in_another_module_is_imported_as_written(tmp_path) -> None:
    """torch's table of storage names has no UntypedStorage: ``x.UntypedStorage`` in
    data.pkl is imported from ``x`` (a module beside the file runs), so it is dangerous."""
    import io
    import subprocess
    import sys
    import zipfile

    import torch

    from ckpt_tools import scan

    (tmp_path / "evilmod.py").write_text("open('imported', 'w').write('yes')\n")
    buf = io.BytesIO()
    torch.save({}, buf)
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for name in src.namelist():
            data = src.read(name)
            if name.endswith("/data.pkl"):
                data = b"\x80\x02cevilmod\nUntypedStorage\n0}q\x00."
            out.writestr(name, data)
    load = (
        "import torch\n"
        "try:\n    torch.load('model.pt', weights_only=False)\n"
        "except Exception:\n    pass"
    )
    subprocess.run([sys.executable, "-c", load], cwd=tmp_path, check=True)
    assert (tmp_path / "imported").exists()  # the oracle: torch.load imported the module
    found = scan([path]).files[0]
    assert found.verdict == "dangerous"
    assert [(f.global_name, f.severity) for f in found.findings] == [
        ("evilmod.UntypedStorage", "dangerous")
    ]
