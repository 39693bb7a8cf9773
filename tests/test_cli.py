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
from diffcheck.cli import COMMANDS, cli, main

HEAVY = ("torch", "vllm", "pyarrow", "numpy")


def _command_paths() -> list[tuple[str, ...]]:
    """Every command and subcommand as an argv prefix, walking click groups recursively."""
    ctx = click.Context(cli)
    paths = []

    def walk(prefix: tuple[str, ...], command: click.Command) -> None:
        paths.append(prefix)
        if isinstance(command, click.Group):
            sub_ctx = click.Context(command, parent=ctx)
            for name in command.list_commands(sub_ctx):
                walk(prefix + (name,), command.get_command(sub_ctx, name))

    for name in sorted(COMMANDS):
        walk((name,), cli.get_command(ctx, name))
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


def test_walk_finds_every_command_and_the_subcommands():
    top = {p[0] for p in PATHS}
    assert top == set(COMMANDS)
    # the groups' subcommands are found too, not just the top level
    assert ("golden", "verify") in PATHS and ("cases", "check") in PATHS and ("model", "prepare") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) for p in PATHS])
def test_help_exits_zero(path):
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage: " in result.output and path[-1] in result.output


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_module_imports(name):
    # LazyGroup turns an ImportError into a placeholder command so the rest of the CLI
    # keeps working; a shipped command must never be that placeholder.
    ctx = click.Context(cli)
    command = cli.get_command(ctx, name)
    assert "[unavailable:" not in (command.help or ""), command.help


def test_short_help_in_the_map_matches_the_listing():
    result = CliRunner().invoke(cli, ["--help"])
    assert result.exit_code == 0
    for name, (_module, short) in COMMANDS.items():
        assert name in result.output and short.split()[0] in result.output


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
