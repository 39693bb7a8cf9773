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
    listing = result.output.split("Commands:", 1)[1]
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
