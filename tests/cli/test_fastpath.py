"""The click-free fast path of ``ckpt strip-module``/``add-module`` (issue 13's lean start).

click is the oracle: the table equals the commands' parameters, every parse agrees with
click's or leaves the line to click, and both ways end a run with the same bytes, the same
output file and the same exit code.
"""

from __future__ import annotations

import ast
import itertools
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import pytest

from ckpt_tools.cli import fastpath
from ckpt_tools.cli.main import cli
from tests.helpers import ckpt_env, console_script, fixture_path

# The same run through click, in a fresh process as the console script is.
_CLICK_WAY = "import sys; from ckpt_tools.cli.main import run; run()"


def _command(name: str) -> click.Command:
    command = cli.get_command(click.Context(cli), name)
    assert command is not None
    return command


def _clicks_table(command: click.Command) -> tuple[dict[str, tuple[str, object]], dict]:
    """The fast path's OPTIONS and defaults, derived from a click command's parameters."""
    options: dict[str, tuple[str, object]] = {}
    for param in command.params:
        if not isinstance(param, click.Option):
            assert isinstance(param, click.Argument) and param.nargs == 1, param
            continue
        if param.name == "help":
            continue  # --help always goes to click
        if param.is_flag and param.secondary_opts:
            kinds = [(param.opts, True), (param.secondary_opts, False)]
        elif param.is_flag:
            # A bool flag stores True (click 8.2+ keeps flag_value unset for those).
            kinds = [(param.opts, True if param.is_bool_flag else param.flag_value)]
        elif param.multiple:
            kinds = [(param.opts, fastpath.MULTIPLE)]
        elif isinstance(param.type, click.Choice):
            kinds = [(param.opts, tuple(param.type.choices))]
        else:
            kinds = [(param.opts, fastpath.VALUE)]
        for opts, kind in kinds:
            options.update((opt, (param.name, kind)) for opt in opts)
    # The defaults as click passes them: its parse of the plainest line.
    defaults = dict(command.make_context(command.name, ["in.pt", "out.pt"]).params)
    del defaults["src"], defaults["dst"]
    return options, defaults


@pytest.mark.parametrize("name", sorted(fastpath.COMMANDS))
def test_the_table_is_the_click_command_s_own(name: str) -> None:
    command = _command(name)
    options, defaults = _clicks_table(command)
    assert options == fastpath.OPTIONS
    assert fastpath.COMMANDS[name] == defaults
    assert [p.name for p in command.params if isinstance(p, click.Argument)] == ["src", "dst"]


def _clicks_parse(name: str, argv: list[str]) -> dict[str, object] | None:
    """The parameters click's callback would get, or None where click refuses the line."""
    try:
        ctx = _command(name).make_context(name, list(argv), resilient_parsing=False)
    except click.exceptions.Exit:
        return None  # --help
    except click.ClickException:
        return None
    return {k: tuple(v) if isinstance(v, list) else v for k, v in ctx.params.items()}


# Tokens the differential test combines: the table's own spellings, values, and the lines
# the fast path must leave to click.
_TOKENS = [
    "a.pt",
    "b.safetensors",
    "",
    "-",
    "--",
    "--force",
    "--in-place",
    "--fsync",
    "--no-fsync",
    "--quiet",
    "-q",
    "-qq",
    "--json",
    "--dry-run",
    "--select",
    "--select=model",
    "--select=",
    "--verify",
    "--verify=full",
    "--verify=fast",
    "none",
    "sizes",
    "--allow-global",
    "--allow-global=a.B",
    "x.Y",
    "--prefix",
    "--prefix=module.",
    "--prefix=-x",
    "_orig_mod.",
    "--force=1",
    "--help",
    "-h",
    "--forc",
    "--unknown",
]


def _lines(seed: int, count: int) -> list[list[str]]:
    """Command lines: the two paths among table options (with fitting or unfitting values),
    now and then a token from _TOKENS anywhere; and each option alone, both sides."""
    rng = random.Random(seed)
    values = {fastpath.VALUE: ["model", "", "x.y"], fastpath.MULTIPLE: ["a.B", "c.D"]}
    lines = []
    for _ in range(count):
        words: list[str] = []
        for opt in rng.choices(list(fastpath.OPTIONS), k=rng.randint(0, 5)):
            kind = fastpath.OPTIONS[opt][1]
            if isinstance(kind, bool):
                words.append(opt)
                continue
            choices = list(kind) if isinstance(kind, tuple) else values[kind]
            value = rng.choice([*choices, "fast"])
            words += [f"{opt}={value}"] if rng.random() < 0.3 else [opt, value]
        for path in ("in.pt", "out.pt"):
            words.insert(rng.randint(0, len(words)), path)
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), rng.choice(_TOKENS))
        lines.append([rng.choice(sorted(fastpath.COMMANDS)), *words])
    for name, opt in itertools.product(sorted(fastpath.COMMANDS), fastpath.OPTIONS):
        lines.append([name, opt, "in.pt", "out.pt"])
        lines.append([name, "in.pt", opt, "sizes", "out.pt"])
    return lines


def test_every_parse_is_click_s_or_left_to_click() -> None:
    taken = 0
    lines = _lines(seed=13, count=3000)
    for argv in lines:
        fast = fastpath.parse(argv)
        clicks = _clicks_parse(argv[0], argv[1:])
        if fast is None:
            continue
        taken += 1
        assert clicks is not None, f"click refuses {argv}, the fast path took it"
        assert fast == (argv[0], clicks), argv
    # Not a parser that leaves everything to click: it takes the common lines.
    assert taken > len(lines) // 2
    assert fastpath.parse(["strip-module", "in.pt", "out.pt"]) is not None
    assert fastpath.parse(["add-module", "--prefix", "m.", "-q", "in.pt", "out.pt"]) is not None


@pytest.mark.parametrize(
    "argv",
    [
        ["strip-module", "a.pt", "b.pt", "--help"],
        ["strip-module", "a.pt"],
        ["strip-module", "a.pt", "b.pt", "c.pt"],
        ["strip-module", "--", "a.pt", "b.pt"],
        ["strip-module", "a.pt", "b.pt", "--verify", "fast"],
        ["strip-module", "a.pt", "b.pt", "--prefix", "-x"],
        ["strip-module", "a.pt", "b.pt", "--quiet=yes"],
        ["rename", "a.pt", "b.pt", "--sub", "a=b"],
        [],
    ],
)
def test_lines_it_leaves_to_click(argv: list[str]) -> None:
    assert fastpath.parse(argv) is None


def test_shell_completion_is_left_to_click(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("_CKPT_COMPLETE", "bash_complete")
    assert fastpath.parse(["strip-module", "a.pt", "b.pt"]) is None


def _both_ways(args: list[str], tmp_path: Path, **env: str) -> list[tuple[int, str, str, bytes]]:
    """Run ``ckpt ARGS`` as the console script, then through click; each run's result.

    ``OUT`` in ``args`` names a fresh output path, the same for both runs (removed between
    them), so that their messages can be compared byte for byte.
    """
    out = tmp_path / "out" / "result.pt"
    results = []
    for command in ([console_script()], [sys.executable, "-c", _CLICK_WAY]):
        if out.parent.exists():
            for f in out.parent.iterdir():
                f.unlink()
        out.parent.mkdir(exist_ok=True)
        argv = [a.replace("OUT", str(out)) if a.startswith("OUT") else a for a in args]
        if "EXISTING" in args:
            out.write_bytes(b"already here")
            argv = [str(out) if a == "EXISTING" else a for a in argv]
        run = subprocess.run(
            [*command, *argv],
            capture_output=True,
            text=True,
            env=ckpt_env(**env),
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        written = b"".join(f.read_bytes() for f in sorted(out.parent.iterdir()))
        results.append((run.returncode, run.stdout, run.stderr, written))
    return results


_DP = str(fixture_path("dataparallel.pt"))
_PLAIN = str(fixture_path("plain.pt"))


@pytest.mark.parametrize(
    "args",
    [
        ["strip-module", _DP, "OUT"],
        ["strip-module", _DP, "OUT", "--quiet", "--no-fsync", "--verify", "full"],
        ["strip-module", "--json", _DP, "OUT"],
        ["strip-module", _DP, "OUT", "--dry-run"],
        ["strip-module", _DP, "OUT", "--prefix", "nothing."],
        ["strip-module", _PLAIN, "OUT"],
        ["strip-module", "missing.pt", "OUT"],
        ["strip-module", _DP, "EXISTING"],
        ["strip-module", _DP, "EXISTING", "--force"],
        ["strip-module", str(fixture_path("evil.pt")), "OUT"],
        ["strip-module", _DP, _DP],
        ["strip-module", _DP, "OUT", "--select", "no.such.path"],
        ["add-module", _PLAIN, "OUT"],
        ["add-module", _PLAIN, "OUT", "--prefix=_orig_mod.", "--json"],
        ["add-module", _PLAIN, "OUT.safetensors"],
    ],
)
def test_both_ways_end_alike(args: list[str], tmp_path: Path) -> None:
    fast, clicks = _both_ways(args, tmp_path)
    assert fast == clicks


def test_with_ckpt_debug_both_ways_raise_the_same_error(tmp_path: Path) -> None:
    fast, clicks = _both_ways(["strip-module", "missing.pt", "OUT"], tmp_path, CKPT_DEBUG="1")
    assert fast[0] == clicks[0] == 1
    last = [r[2].strip().splitlines()[-1] for r in (fast, clicks)]
    assert last[0] == last[1] and last[0].startswith("ckpt_tools.errors.")


def _modules_after(
    argv: list[str], tmp_path: Path
) -> tuple[list[str], subprocess.CompletedProcess]:
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('click', 'tabulate', 'torch'))))\n"
        f"sys.argv = ['ckpt', *{argv!r}]\n"
        "from ckpt_tools.cli.entry import run\n"
        "run()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=ckpt_env(),
        cwd=tmp_path,
        timeout=120,
    )
    return ast.literal_eval(run.stdout.splitlines()[-1]), run


def test_the_fast_path_loads_no_click(tmp_path: Path) -> None:
    loaded, run = _modules_after(["strip-module", _DP, "out.pt", "--json"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert loaded == []
    loaded, run = _modules_after(["strip-module", _DP, "out.pt"], tmp_path)  # exists: exit 6
    assert run.returncode == 6 and "already exists" in run.stderr
    assert loaded == []
    # Left to click, click runs it.
    loaded, run = _modules_after(["strip-module", "--help"], tmp_path)
    assert run.returncode == 0 and "Usage: ckpt strip-module" in run.stdout
    assert "click" in loaded


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("src", [_DP, "missing.pt"])
def test_a_broken_pipe_ends_as_click_ends(stream: str, src: str, tmp_path: Path) -> None:
    # The reader of one stream is gone before anything is printed. What needed that stream
    # ends with exit 1 both ways: a success that cannot report (stdout), a failure that
    # cannot say why (stderr), which must never pass for a success (0).
    results = []
    out = tmp_path / "out.pt"
    for command in ([console_script()], [sys.executable, "-c", _CLICK_WAY]):
        out.unlink(missing_ok=True)
        read, write = os.pipe()
        os.close(read)
        other = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: write}
        try:
            run = subprocess.run(
                [*command, "strip-module", src, str(out)], env=ckpt_env(), timeout=120, **other
            )
        finally:
            os.close(write)
        results.append((run.returncode, run.stdout, run.stderr, out.exists()))
    assert results[0] == results[1]
    code, _, _, written = results[0]
    assert written == (src == _DP)
    expected = {("stdout", _DP): 1, ("stderr", _DP): 0, ("stderr", "missing.pt"): 1}
    assert code == expected.get((stream, src), 2)  # (2: the missing input, said on stderr)


def _as_another_user() -> list[str]:
    """The prefix that runs a command as a user who cannot read other users' 0o200 files."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root, and no setpriv to drop privileges with: root reads every file")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.parametrize("case", ["unreadable input", "unreadable output", "unreadable folder"])
def test_paths_click_finds_unreadable_are_left_to_click(case: str) -> None:
    # click.Path() refuses an existing path this user cannot read (exit 2, nothing written);
    # the fast path must leave such a line to click, not overwrite the file.
    prefix = _as_another_user()
    folder = Path(tempfile.mkdtemp(prefix="ckpt-unreadable-"))  # under /tmp, for any user
    try:
        folder.chmod(0o777)
        src, dst = folder / "in.pt", folder / "out.pt"
        src.write_bytes(Path(_DP).read_bytes())
        if case == "unreadable input":
            src.chmod(0o200)
        elif case == "unreadable output":
            dst.write_bytes(b"keep me")
            dst.chmod(0o222)
        else:
            dst = folder / "sub"
            dst.mkdir(mode=0o333)
            dst.chmod(0o333)
        results = []
        for command in ([console_script()], [sys.executable, "-c", _CLICK_WAY]):
            run = subprocess.run(
                [*prefix, *command, "strip-module", str(src), str(dst), "--force"],
                capture_output=True,
                text=True,
                env=ckpt_env(),
                cwd=folder,
                timeout=120,
            )
            left = sorted(p.name for p in folder.iterdir())
            results.append((run.returncode, run.stdout, run.stderr, left))
        assert results[0] == results[1]
        assert results[0][0] == 2 and "is not readable" in results[0][2]
        if case == "unreadable output":
            dst.chmod(0o600)
            assert dst.read_bytes() == b"keep me"
    finally:
        for p in folder.iterdir():
            p.chmod(0o700)
        shutil.rmtree(folder)


_ECHO = """
import sys, click
from ckpt_tools.cli.boundary import echo
for text in {texts!r}:
    echo(text)
    click.echo(text)
    echo(text, err=True)
    click.echo(text, err=True)
"""


@pytest.mark.parametrize("encoding", ["utf-8", "ascii"])
def test_echo_writes_what_click_echo_writes(encoding: str) -> None:
    texts = ["plain", "", "two\nlines", "key \x1b[31mred\x1b[0m", "caf\u00e9", "tab\tend "]
    run = subprocess.run(
        [sys.executable, "-c", _ECHO.format(texts=texts)],
        capture_output=True,
        env=ckpt_env(PYTHONIOENCODING=encoding),
        timeout=60,
        check=True,
    )
    for stream in (run.stdout, run.stderr):
        lines = stream.split(b"\n")[:-1]
        # Each text was printed twice in a row, once each way: the halves must be equal.
        chunks, i = [], 0
        for text in texts:
            n = text.count("\n") + 1
            chunks.append((lines[i : i + n], lines[i + n : i + 2 * n]))
            i += 2 * n
        for ours, clicks in chunks:
            assert ours == clicks
