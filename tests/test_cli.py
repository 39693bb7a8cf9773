"""The command line itself: every command's --help, lazy imports, --version.

The per-command behaviour (what `golden verify` prints, ...) is tested beside each
command; this file holds what every command shares. Error output and exit codes
are in test_cli_errors.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from diffcheck import __version__
from diffcheck.cli import cli, main

HEAVY = ("torch", "vllm", "pyarrow", "numpy")
# The commands the docs (README.md, docs/) promise users, with their subcommands. Written out
# here, not read from the CLI's own command map, so that a command that disappears or is
# renamed fails a test. The CLI may offer more; a new command joins this list once documented.
PROMISED = {
    "bisect": [],
    "cases": ["check", "list", "show"],
    "check": [],
    "compare": [],
    "golden": ["export", "record", "show", "verify"],
    "init": [],
    "kernels": [],
    "ledger": [],
    "matrix": [],
    "model": ["prepare"],
    "run": [],
    "selftest": [],
}
PROMISED_PATHS = [(name,) for name in PROMISED] + [(name, sub) for name, subs in PROMISED.items() for sub in subs]


def _command_paths() -> list[tuple[str, ...]]:
    """Every command and subcommand the CLI itself lists, as an argv prefix (click groups walked recursively)."""
    ctx = click.Context(cli)
    paths = []

    def walk(prefix: tuple[str, ...], command: click.Command) -> None:
        if prefix:
            paths.append(prefix)
        if isinstance(command, click.Group):
            sub_ctx = click.Context(command, parent=ctx)
            for name in command.list_commands(sub_ctx):
                walk(prefix + (name,), command.get_command(sub_ctx, name))

    walk((), cli)
    return paths


PATHS = _command_paths()


def _probe(argvs: list[list[str]]) -> dict:
    """Call diffcheck.cli.main on each argv in ONE fresh interpreter; report exit codes and heavy imports."""
    code = (
        "import contextlib, io, json, sys\n"
        "from diffcheck.cli import main\n"
        "rcs = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        rcs.append(main(argv))\n"
        "print(json.dumps({'rcs': rcs, 'heavy': sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argvs), json.dumps(HEAVY)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cli_offers_every_promised_command():
    missing = sorted(set(PROMISED_PATHS) - set(PATHS))
    assert not missing, f"promised but not offered: {missing}"


def test_top_level_help_lists_each_promised_command_with_a_description():
    result = CliRunner().invoke(cli, ["--help"], prog_name="diffcheck")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: diffcheck [OPTIONS] COMMAND [ARGS]...")
    listing = result.output.split("Commands:", 1)[1].split("\n\n", 1)[0]  # the examples follow
    rows = dict(line.split(None, 1) for line in listing.strip().splitlines())
    assert set(PROMISED) <= set(rows), sorted(rows)
    assert all(len(text.split()) >= 3 for text in rows.values()), rows  # a description, not a stub


@pytest.mark.parametrize("path", PROMISED_PATHS, ids=[" ".join(p) for p in PROMISED_PATHS])
def test_help_exits_zero_with_a_usage_line(path):
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="diffcheck")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: diffcheck {' '.join(path)} [OPTIONS]"), result.output


@pytest.mark.parametrize("name", list(PROMISED))
def test_every_command_module_imports(name):
    # LazyGroup turns an ImportError into a placeholder command so the rest of the CLI
    # keeps working; a shipped command must never be that placeholder.
    result = CliRunner().invoke(cli, [name, "--help"], prog_name="diffcheck")
    assert result.exit_code == 0 and "[unavailable:" not in result.output, result.output


def test_top_level_help_imports_no_heavy_module():
    probe = _probe([["--help"], ["compare", "--help"]])
    assert probe["rcs"] == [0, 0]
    assert probe["heavy"] == [], f"`diffcheck --help` / `compare --help` imported {probe['heavy']}"


def test_no_subcommand_help_imports_torch_or_vllm():
    probe = _probe([[*p, "--help"] for p in PATHS])
    assert probe["rcs"] == [0] * len(PATHS)
    assert not {"torch", "vllm"} & set(probe["heavy"]), f"some --help imported {probe['heavy']}"


def test_console_script_help_and_version():
    script = Path(sys.executable).parent / "diffcheck"
    assert script.exists(), "the `diffcheck` console script is not installed in this venv"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Usage: diffcheck" in out.stdout and out.stderr == ""
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"diffcheck, version {__version__}"


def test_main_returns_codes_instead_of_exiting(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"diffcheck, version {__version__}"
    assert main(["--help"]) == 0
    assert "Exit codes" in capsys.readouterr().out


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "diffcheck.cli", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and __version__ in out.stdout


def test_global_options_stand_anywhere_and_json_goes_to_a_file_or_stdout(tmp_path, capsys):
    from diffcheck.cli import _globals_first

    assert _globals_first(["compare", "O", "-v"]) == ["-v", "compare", "O"]
    assert _globals_first(["bisect", "K", "--", "-v"]) == ["bisect", "K", "--", "-v"]
    out = tmp_path / "show.json"
    assert main(["cases", "show", "O", "-v", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["id"] == "O"
    assert main(["cases", "show", "O", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == "O"


# -- every --help ends with examples that work on the shipped default suite ----------------------
REPO = Path(__file__).resolve().parent.parent
CASE_ID_PARAMS = ("case_id", "case_ids")


def _command(path: tuple[str, ...]) -> click.Command:
    command, ctx = cli, click.Context(cli)
    for name in path:
        command = command.get_command(ctx, name)
        ctx = click.Context(command, parent=ctx, info_name=name)
    return command


def _examples(path: tuple[str, ...]) -> list[str]:
    """The example lines of a command: its epilog, one `\\b` block headed Examples: (the one mechanism)."""
    epilog = _command(path).epilog or ""
    assert epilog.startswith("\b\nExamples:\n"), f"`diffcheck {' '.join(path)}`: no Examples: epilog: {epilog!r}"
    lines = [line.strip() for line in epilog.splitlines()[2:] if line.strip()]
    assert 1 <= len(lines) <= 2, lines
    return lines


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) for p in PATHS])
def test_every_help_ends_with_an_example_of_that_command(path):
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="diffcheck", terminal_width=200)
    assert result.exit_code == 0, result.output
    last = result.output.rstrip().splitlines()[-1].strip()
    prefix = "diffcheck " + " ".join(path)
    assert last == prefix or last.startswith(prefix + " "), f"--help of `{prefix}` ends with {last!r}"
    assert last == _examples(path)[-1]


def _parse_example(line: str) -> tuple[click.Command, dict]:
    """An example line, parsed by click's own parser for its command: unknown options and extra arguments
    raise. Values are not converted (the ../vllm of bisect --repo is the user's checkout)."""
    import shlex

    words = shlex.split(line, comments=True)
    assert words[0] == "diffcheck", line
    command, ctx, rest = cli, click.Context(cli), words[1:]
    while isinstance(command, click.Group):
        assert rest and rest[0] in command.list_commands(ctx), f"{line}: no such subcommand"
        command = command.get_command(ctx, rest[0])
        ctx, rest = click.Context(command, parent=ctx, info_name=rest[0]), rest[1:]
    opts, left, _ = command.make_parser(ctx).parse_args(rest)
    assert not left, f"{line}: arguments left over: {left}"
    given = {}  # what the line gives; the parser marks what it leaves out with a sentinel
    for name, value in opts.items():
        values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, (str, bool))]
        if values:
            given[name] = values if isinstance(value, (list, tuple)) else values[0]
    return command, given


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) for p in PATHS])
def test_help_examples_name_real_options_cases_and_files(path, monkeypatch):
    from diffcheck import cases
    from diffcheck.engines import models

    monkeypatch.chdir(REPO)
    for var in ("DIFFCHECK_CASES", "DIFFCHECK_GOLDENS", "DIFFCHECK_SUITE"):
        monkeypatch.delenv(var, raising=False)
    for line in _examples(path):
        command, opts = _parse_example(line)
        params = {p.name: p for p in command.params}
        for name in (p.name for p in command.params if p.required):
            assert name in opts, f"{line}: {name} missing"
        suite = cases.load_suite(opts.get("suite", "default"))  # the shipped default suite unless named
        for name, value in opts.items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if name in CASE_ID_PARAMS or (name == "target" and "/" not in value):
                assert all(v in suite.cases for v in values), f"{line}: no case {values} in suite {suite.name}"
            if name == "model_id":
                assert value in models.KNOWN_MODELS, f"{line}: unknown model {value}"
            if isinstance(params[name].type, click.Choice):
                assert all(v in params[name].type.choices for v in values), f"{line}: {name}={values}"
            for v in (v for v in values if isinstance(v, str)):
                file = v.partition("=")[2] if "=" in v else v
                if file.startswith("goldens/default/"):  # recorded by `golden record`/`run`, not committed
                    case_id = Path(file).name.split(".")[0]
                    assert case_id in cases.load_suite("default").cases, f"{line}: {file} is no default case's"
                elif file.startswith(("goldens/", "cases/")):
                    assert (REPO / file).exists(), f"{line}: {file} does not exist"


def test_no_help_pastes_the_pass_fail_policy():
    # Which verdicts pass is diffcheck.core.types' alone (table: docs/verdicts.md). It imports numpy, so no
    # --help asks it, and none may carry its own copy of the list.
    for path in [(), *PATHS]:
        out = CliRunner().invoke(cli, [*path, "--help"], prog_name="diffcheck").output
        for name in ("IDENTICAL", "BENIGN_DRIFT", "DEGRADED", "GIBBERISH"):
            assert name not in out, f"`diffcheck {' '.join(path)} --help` names {name}"
