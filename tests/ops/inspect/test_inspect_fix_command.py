"""``ckpt inspect``'s "strip them:" command, run exactly as printed, writes a checkpoint that
loads strictly into the unwrapped model."""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
from torch import nn

import ckpt_tools as ct
from tests.helpers import run_ckpt


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1))


def _wrapped(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"module.{k}": v for k, v in model.state_dict().items()}


def _run_suggestion(*inspect_args: object) -> list[str]:
    """Run the command inspect suggests, as printed; return its arguments."""
    out = run_ckpt("inspect", *inspect_args).stdout
    line = next(line for line in out.splitlines() if "strip them:" in line)
    argv = shlex.split(line.split("strip them:", 1)[1])
    assert argv[0] == "ckpt", line
    run_ckpt(*argv[1:])
    return argv


def _loads_strictly(state_dict: dict[str, torch.Tensor], model: nn.Module) -> None:
    fresh = _model(seed=99)
    fresh.load_state_dict(state_dict, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_the_suggestion_quotes_a_path_with_a_space(tmp_path: Path) -> None:
    model = _model(seed=1)
    src = tmp_path / "my ddp.pt"
    torch.save(_wrapped(model), src)
    argv = _run_suggestion(src)
    assert argv[1:3] == ["strip-module", str(src)]
    _loads_strictly(torch.load(argv[3], weights_only=True), model)


def test_the_suggestion_keeps_the_selected_state_dict(tmp_path: Path) -> None:
    plain, ema = _model(seed=1), _model(seed=2)
    src = tmp_path / "timm.pt"
    torch.save({"state_dict": plain.state_dict(), "state_dict_ema": _wrapped(ema)}, src)
    argv = _run_suggestion(src, "--select", "state_dict_ema")
    assert argv[-2:] == ["--select", "state_dict_ema"]
    written = torch.load(argv[3], weights_only=True)
    _loads_strictly(written["state_dict_ema"], ema)
    _loads_strictly(written["state_dict"], plain)


def test_the_python_hint_keeps_the_selected_state_dict(tmp_path: Path) -> None:
    src = tmp_path / "timm.pt"
    torch.save({"state_dict": {}, "state_dict_ema": _wrapped(_model(seed=2))}, src)
    text = str(ct.inspect(src, select="state_dict_ema"))
    assert f"ckpt_tools.strip_module({str(src)!r}, OUT, select='state_dict_ema')" in text


class _Holds(nn.Module):
    """A classifier whose only child is its own attribute ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model(seed=3)


def test_the_suggestion_keeps_a_models_own_model_attribute(tmp_path: Path) -> None:
    # Under DataParallel (or compile) `model.` is the classifier's attribute, not Lightning's.
    model = _Holds()
    src = tmp_path / "dp.pt"
    torch.save(nn.DataParallel(model).state_dict(), src)
    argv = _run_suggestion(src)
    fresh = _Holds()
    fresh.load_state_dict(torch.load(argv[3], weights_only=True), strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_transformers_and_peft_files_keep_their_own_prefixes(tmp_path: Path) -> None:
    # Every key of a tied-embedding transformers model lies under its `model` attribute, which
    # from_pretrained needs; a PEFT adapter's keys are the ones PEFT loads, prefix included.
    folder = tmp_path / "hf"
    folder.mkdir()
    torch.save({"model.embed.weight": torch.ones(4, 2)}, folder / "pytorch_model.bin")
    torch.save({"model.embed.weight": torch.ones(4, 2)}, tmp_path / "lightning.pt")
    torch.save({"model.embed.weight": torch.ones(4, 2)}, tmp_path / "model.bin")  # no HF name
    adapter = {
        "base_model.model.model.q.lora_A.weight": torch.ones(2, 4),
        "base_model.model.model.q.lora_B.weight": torch.ones(4, 2),
    }
    torch.save(adapter, tmp_path / "adapter.pt")
    assert [w.prefix for w in ct.inspect(folder / "pytorch_model.bin").wrappers] == []
    assert [w.prefix for w in ct.inspect(tmp_path / "adapter.pt").wrappers] == []
    assert [w.prefix for w in ct.inspect(tmp_path / "lightning.pt").wrappers] == ["model."]
    assert [w.prefix for w in ct.inspect(tmp_path / "model.bin").wrappers] == ["model."]


def test_strip_module_strips_what_inspect_names_and_nothing_else(tmp_path: Path) -> None:
    # An adapter of any kind (IA3 has no lora_A) and a transformers file keep their prefixes
    # under strip-module too: stripping them made PEFT load nothing, and a strict load fail.
    ia3 = {"base_model.model.model.q.ia3_l": torch.ones(4, 1)}
    files = {
        "adapter_model.safetensors": ia3,
        "hf/pytorch_model.bin": {"model.embed.weight": torch.ones(4, 2)},
        "lora.pt": {"base_model.model.model.q.lora_A.weight": torch.ones(2, 4)},
    }
    for name, sd in files.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        if name.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(sd, path)
        else:
            torch.save(sd, path)
        assert ct.inspect(path).wrappers == ()
        result = ct.strip_module(path, tmp_path / f"out-{path.name}")
        assert result.written == () and not (tmp_path / f"out-{path.name}").exists(), name
    # Asked for by name, the prefix is stripped.
    out = tmp_path / "named.pt"
    ct.strip_module(tmp_path / "lora.pt", out, prefix="base_model.model.")
    assert list(torch.load(out)) == ["model.q.lora_A.weight"]


def test_json_tells_a_wrapper_inside_keys_from_one_that_starts_them(tmp_path: Path) -> None:
    fsdp = "_fsdp_wrapped_module."
    sd = {f"{fsdp}fc1.{fsdp}weight": torch.ones(2), f"{fsdp}fc2.weight": torch.ones(2)}
    torch.save(sd, tmp_path / "fsdp.pt")
    wrappers = ct.inspect(tmp_path / "fsdp.pt").to_json()["wrappers"]
    assert [(w["prefix"], w["count"], w["inner"]) for w in wrappers] == [
        (fsdp, 2, False),
        (fsdp, 1, True),
    ]


def test_the_suggestion_for_a_sharded_folder_writes_its_format(tmp_path: Path) -> None:
    # A folder's name is no stem (llama-3.1-8b), and its safetensors shards stay safetensors.
    from safetensors.torch import load_file

    model = _model(seed=1)
    folder = tmp_path / "llama-3.1-8b"
    ct.convert(_save(tmp_path, _wrapped(model)), folder, max_shard_size=16)
    assert len(list(folder.glob("*.safetensors"))) > 1
    argv = _run_suggestion(folder)
    assert argv[3] == f"{folder}.renamed.safetensors"
    _loads_strictly(load_file(argv[3]), model)
    # With no suffix to go by, the folder's family decides, as a file's would.
    ct.strip_module(folder, tmp_path / "plain")
    assert ct.inspect(tmp_path / "plain").format == "safetensors"


def _save(tmp_path: Path, state_dict: dict[str, torch.Tensor]) -> Path:
    torch.save(state_dict, tmp_path / "ddp.pt")
    return tmp_path / "ddp.pt"


def test_the_suggestion_names_the_globals_the_rewrite_must_carry(tmp_path: Path) -> None:
    # Lightning keeps its hyper-parameters as a Namespace: a rewrite refuses it unless named.
    import argparse

    model = _model(seed=1)
    src = tmp_path / "last.ckpt"
    hyper = {"args": argparse.Namespace(lr=0.1)}
    torch.save({"state_dict": _wrapped(model), "hyper_parameters": hyper, "epoch": 3}, src)
    argv = _run_suggestion(src)
    assert argv[-2:] == ["--allow-global", "argparse.Namespace"]
    _loads_strictly(torch.load(argv[3], weights_only=False)["state_dict"], model)


def test_the_suggestion_for_a_pickled_module_writes_its_state_dict(tmp_path: Path) -> None:
    # torch.save(DataParallel(model)): a .pt rewrite would carry the module; safetensors
    # holds its recovered state dict.
    from safetensors.torch import load_file

    model = _model(seed=1)
    src = tmp_path / "whole_dp.pt"
    torch.save(nn.DataParallel(model), src)
    argv = _run_suggestion(src)
    assert argv[3].endswith("whole_dp.renamed.safetensors")
    _loads_strictly(load_file(argv[3]), model)


def test_a_dcp_folder_is_consolidated_with_its_wrappers_stripped(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = _model(seed=3)
    step = tmp_path / "step"
    dcp.save({"model": _wrapped(model)}, checkpoint_id=step)
    argv = _run_suggestion(step)
    assert argv[1] == "consolidate" and "--strip" in argv
    _loads_strictly(torch.load(argv[3], weights_only=True), model)


def test_a_dcp_folder_with_another_fix_is_consolidated_then_rewritten(tmp_path: Path) -> None:
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    from ckpt_tools.structure.steps import Step, fix_command

    model = _model(seed=4)
    step = tmp_path / "step"
    dcp.save({f"net.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=step)
    line = fix_command(str(step), [Step("strip", "net.")], fmt="dcp")
    assert line.count(" && ") == 1 and line.startswith("ckpt consolidate ")
    ckpt = shlex.quote(str(Path(sys.executable).with_name("ckpt")))
    subprocess.run(line.replace("ckpt ", f"{ckpt} "), shell=True, check=True, cwd=tmp_path)
    _loads_strictly(torch.load(tmp_path / "step.renamed.pt", weights_only=True), model)


def test_a_pickled_wrapped_module_beside_other_entries_is_written_without_them(
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    model = _model(seed=5)
    src = tmp_path / "nested.pt"
    torch.save({"model": nn.DataParallel(model), "epoch": 3}, src)
    argv = _run_suggestion(src)
    assert argv[-1] == "--drop-extras" and argv[3].endswith(".safetensors")
    _loads_strictly(load_file(argv[3]), model)


def test_a_torchscript_archive_gets_no_rewrite_command(tmp_path: Path) -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    torch.jit.save(torch.jit.script(Holder()), tmp_path / "ts.pt")
    out = run_ckpt("inspect", tmp_path / "ts.pt").stdout
    line = next(line for line in out.splitlines() if "strip them:" in line)
    assert "ckpt " not in line and "torch.jit.load" in line


def test_a_suggestion_for_a_name_holding_a_tab_runs_in_bash(tmp_path: Path) -> None:
    # The terminal gets no tab (it is shown escaped), and bash reads $'...' back as one.
    import subprocess
    import sys

    model = _model(seed=5)
    src = tmp_path / "run\t1.pt"
    torch.save(_wrapped(model), src)
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    ckpt = shlex.quote(str(Path(sys.executable).with_name("ckpt")))
    inspected = run_ckpt("inspect", src).stdout
    diffed = run_ckpt("diff", src, tmp_path / "plain.pt", code=None).stdout
    for said, out in ((inspected, "run\t1.renamed.pt"), (diffed, "run\t1.renamed.pt")):
        line = next(ln for ln in said.splitlines() if "ckpt strip-module" in ln)
        command = "ckpt strip-module" + line.split("ckpt strip-module", 1)[1].split(" (")[0]
        assert "\t" not in command and "$'" in command, command
        (tmp_path / out).unlink(missing_ok=True)
        bash = command.replace("ckpt ", f"{ckpt} ", 1)
        subprocess.run(["bash", "-c", bash], check=True, cwd=tmp_path)
        _loads_strictly(torch.load(tmp_path / out, weights_only=True), model)
