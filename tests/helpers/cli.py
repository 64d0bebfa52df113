"""The one runner of the ``ckpt`` command: in this process, or in a fresh one.

In this process, :func:`run_ckpt` calls :func:`ckpt_tools.cli.main.main`, the real
boundary that turns errors into exit codes, under click's ``CliRunner`` isolation (stdout
and stderr captured apart, ``CKPT_DEBUG`` unset). In a fresh process it runs
``python -m ckpt_tools`` or the installed ``ckpt`` console script, with a timeout.
:func:`modules_loaded_by` runs a line of Python in a fresh process and says what it imported.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal, NamedTuple

from click.testing import CliRunner

from ckpt_tools.cli.main import main
from tests.helpers.committed import ROOT

How = Literal["in-process", "module", "script"]


class CkptResult(NamedTuple):
    """What one run of ``ckpt`` gave.

    A named tuple so that both ``code, out, err = run_ckpt(...)`` and ``result.stdout``
    read naturally; the field names are ``subprocess.CompletedProcess``'s.
    """

    returncode: int
    stdout: str
    stderr: str


def ckpt_env(**extra: str) -> dict[str, str]:
    """The environment for a child process that runs this checkout's ``ckpt_tools``.

    Args:
        **extra: variables to set. A ``PYTHONPATH`` among them goes first on the path.

    Returns:
        ``os.environ`` without ``CKPT_DEBUG`` (a developer's setting must not change what a
        test sees), with ``extra`` and this checkout on ``PYTHONPATH``.
    """
    env = {k: v for k, v in os.environ.items() if k != "CKPT_DEBUG"}
    paths = [extra.pop("PYTHONPATH", ""), str(ROOT), env.get("PYTHONPATH", "")]
    env.update(extra)
    entries = [p for part in paths for p in part.split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    return env


def console_script() -> str:
    """The installed ``ckpt`` console script (fails the test when it is not installed)."""
    found = shutil.which("ckpt") or str(Path(sys.executable).with_name("ckpt"))
    assert Path(found).exists(), "the `ckpt` console script is not installed (pip install -e .)"
    return found


def torch_free_env(folder: Path, why: str = "this command must not import torch") -> dict[str, str]:
    """A child-process environment in which ``import torch`` fails with ``why``.

    A fake ``torch`` package that raises on import goes first on ``PYTHONPATH``, so a run
    that passes in this environment proves the command never imported torch.

    Args:
        folder: where to write the fake package (a test's ``tmp_path``).
        why: the ImportError's message, which the test may look for.

    Returns:
        The environment (see :func:`ckpt_env`).
    """
    fake = Path(folder) / "fake-torch"
    (fake / "torch").mkdir(parents=True, exist_ok=True)
    (fake / "torch" / "__init__.py").write_text(f"raise ImportError({why!r})\n")
    return ckpt_env(PYTHONPATH=str(fake))


def modules_loaded_by(code: str, packages: Collection[str]) -> list[str]:
    """The modules of ``packages`` (top-level names) that ``code`` leaves imported in a fresh
    interpreter, sorted: what an import costs, unaffected by this process's imports."""
    probe = (
        f"import sys\n{code}\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(packages)!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def assert_refused_alike(path: Path, error: type[Exception], match: str, says: str) -> None:
    """The library and the command refuse ``path`` alike: ``open_checkpoint`` raises ``error``
    (its message matching ``match``), ``ckpt inspect`` exits 4 with one stderr line saying
    ``says``. The command runs with a timeout: a read that blocks fails, not hangs."""
    import pytest

    from ckpt_tools.formats import open_checkpoint

    with pytest.raises(error, match=match):
        open_checkpoint(path)
    result = run_ckpt("inspect", path, code=4, how="script", timeout=30)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def run_ckpt(
    *args: object,
    code: int | None = 0,
    how: How = "in-process",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 120,
) -> CkptResult:
    """Run ``ckpt ARGS`` and return its exit code and output.

    Args:
        *args: the command line after ``ckpt`` (paths and numbers are turned into strings).
        code: the exit code the run must end with (the assertion shows both streams);
            None to check nothing.
        how: ``in-process`` (fast, through ``main()``), ``module`` (``python -m
            ckpt_tools`` in a fresh process: import-time behaviour, signals, environment)
            or ``script`` (the installed console script).
        env: extra environment variables (see :func:`ckpt_env` for a fresh process).
        cwd: the working folder of a fresh process.
        timeout: seconds a fresh process may take before the test fails; generous, so that
            it only turns a hang into a failure.

    Returns:
        The :class:`CkptResult`.
    """
    argv = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]
    if how == "in-process":
        assert cwd is None, "in-process runs use the test's own working folder"
        # CKPT_DEBUG=1 would re-raise instead of printing the one-line error under test.
        overrides: dict[str, str | None] = {"CKPT_DEBUG": None, **(env or {})}
        with CliRunner().isolation(env=overrides) as (out, err, _):
            try:
                returncode = main(argv)
            finally:
                sys.stdout.flush()  # the captured streams are text wrappers over `out`/`err`
                sys.stderr.flush()
        result = CkptResult(returncode, out.getvalue().decode(), err.getvalue().decode())
    else:
        command = [console_script()] if how == "script" else [sys.executable, "-m", "ckpt_tools"]
        proc = subprocess.run(
            [*command, *argv],
            capture_output=True,
            text=True,
            env=ckpt_env(**(env or {})),
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
        result = CkptResult(proc.returncode, proc.stdout, proc.stderr)
    if code is not None:
        assert result.returncode == code, (
            f"ckpt {' '.join(argv)}: exit {result.returncode}, expected {code}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result
