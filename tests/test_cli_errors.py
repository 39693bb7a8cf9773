"""How the CLI fails: user errors are one line and exit 2, engine failures one line and
exit 3 (125 with --bisect-codes), internal bugs keep their traceback.

The one-line contract: stderr holds exactly one ``diffcheck: error: ...`` line that
names the file (and field) at fault, and no traceback. Commands that reach the engine
may log their own progress first, but the error line comes last and no engine log
line or traceback reaches stderr (they belong in the engine log file).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import click
import pytest

from diffcheck import cli as climod
from diffcheck.core.errors import ConfigError, EngineError
from diffcheck.core.types import Run

from factories import make_run, suite_text, write_suite

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "cases" / "prompts" / "smoke-en.toml"
SCRIPT = Path(sys.executable).parent / "diffcheck"
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "X": {"inherits": "J", "role": "candidate", "references": ["J"],
          "description": "a context longer than the model allows: vLLM refuses to start",
          "engine": {"max_model_len": 10000000}},
}
SAMPLING = {"max_tokens": 8, "temperature": 0.7, "seed": 1, "logprobs": 4}


def errs_suite(cases: dict = CASES, sampling: dict = SAMPLING) -> str:
    return suite_text(cases, name="errs", description="CLI error tests", prompts=PROMPTS, sampling=sampling,
                      engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024,
                              "kv_cache_memory_gib": 1})


# Each breaks the suite in one way; the error line must name the file and what is wrong.
BAD_SUITES = {
    "invalid-toml": ("[suite\nname = 'errs'", "invalid TOML"),
    "bad-value": (errs_suite(sampling={**SAMPLING, "temperature": "hot"}), "temperature"),
    "unknown-key": (errs_suite({**CASES, "J": {**CASES["J"], "colour": "blue"}}), "colour"),
    "unknown-reference": (errs_suite({**CASES, "X": {**CASES["X"], "references": ["Q"]}}), "'Q'"),
}
# Every command that reads a suite; none may start an engine before the suite is valid.
SUITE_COMMANDS = [["cases", "show", "X"], ["golden", "verify"], ["golden", "record", "J"], ["run", "X"],
                  ["compare", "X"], ["check"]]
# Engine log lines that must never reach the user's terminal on failure.
ENGINE_NOISE = (" INFO ", " WARNING ", "Triton is installed")


def write_errs_suite(folder: Path, text: str | None = None) -> Path:
    return write_suite(folder, name="errs", text=errs_suite() if text is None else text)


def synthetic_run(*, suite: str = "errs", case_id: str = "J", k: int = 4) -> Run:
    """A small, valid golden-shaped run: two sequences of 5 and 3 steps."""
    return make_run(lengths=(5, 3), k=k, suite=suite, case_id=case_id, texts=["text 0", "text 1"],
                    engine={"name": "vllm", "version": "0.32.0"}, model={"id": "smollm2-135m", "digest": "0" * 64},
                    sampling={"max_tokens": 5, "logprobs": k})


def one_error_line(stderr: str) -> str:
    """The single ``diffcheck: error:`` line of `stderr`; fails on a traceback or any other line."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("diffcheck: error: "), lines[0]
    return lines[0]


def final_error_line(stderr: str) -> str:
    """For commands that log progress before failing: one error line, last, and nothing from the engine.

    diffcheck's own progress lines ("X: starting candidate engine") may precede it; vLLM's
    log lines and tracebacks may not (they go to the engine log file).
    """
    assert "Traceback" not in stderr, stderr
    assert not any(noise in stderr for noise in ENGINE_NOISE), f"engine output reached stderr:\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("diffcheck: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one final error line:\n{stderr}"
    return errors[0]


def run_cli(args: list[str], *, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), "the `diffcheck` console script is not installed in this venv"
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def suite_path(tmp_path) -> Path:
    return write_errs_suite(tmp_path / "cases")


# -- user errors: exit 2, one line ---------------------------------------------------------------


@pytest.mark.parametrize("command", SUITE_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("kind", sorted(BAD_SUITES))
def test_bad_suite_file_is_one_line_exit_2(tmp_path, capsys, kind, command):
    text, what = BAD_SUITES[kind]
    path = write_errs_suite(tmp_path / "cases", text)
    rc = climod.main([*command, "--suite", str(path)]
                     + (["--goldens", str(tmp_path / "goldens")] if command[0] != "cases" else []))
    err = capsys.readouterr().err
    assert rc == 2
    line = one_error_line(err)
    assert "errs.toml" in line and what in line


@pytest.mark.parametrize("command", [["cases", "show"], ["golden", "record"], ["run"], ["compare"]], ids=" ".join)
def test_unknown_case_id_is_one_line_exit_2(tmp_path, suite_path, capsys, command):
    rc = climod.main([*command, "NOPE", "--suite", str(suite_path)]
                     + (["--goldens", str(tmp_path / "goldens")] if command[0] != "cases" else []))
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2
    assert "NOPE" in line and "errs.toml" in line
    assert "J" in line and "X" in line  # names the valid ids


def test_user_error_in_a_real_process(tmp_path, suite_path):
    out = run_cli(["cases", "show", "NOPE", "--suite", str(suite_path)], cwd=tmp_path)
    assert out.returncode == 2
    assert "NOPE" in one_error_line(out.stderr)
    assert out.stdout == ""


def test_missing_suite_names_what_exists(tmp_path, monkeypatch, capsys):
    write_errs_suite(tmp_path / "cases")
    monkeypatch.setenv("DIFFCHECK_CASES", str(tmp_path / "cases"))
    rc = climod.main(["cases", "show", "J", "--suite", "no-such-suite"])
    assert rc == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no-such-suite" in line and "errs" in line  # what was asked for, and what exists


def test_usage_errors_exit_2_without_traceback(capsys):
    assert climod.main(["no-such-command"]) == 2
    assert climod.main(["cases", "show"]) == 2  # missing CASE_ID
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no-such-command" in err and "CASE_ID" in err


# -- corrupt goldens: exit 2, one line naming the file ---------------------------------------------


@pytest.fixture
def corrupt_golden(tmp_path, suite_path):
    """A golden for J written by the store, verified good, then one byte flipped."""
    from diffcheck.storage import store

    root = tmp_path / "goldens"
    path = store.run_path(root, "errs", "J")
    store.write_run(path, synthetic_run())
    assert climod.main(["golden", "verify", "--suite", str(suite_path), "--goldens", str(root)]) == 0
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return root, path


@pytest.mark.parametrize("command", [["golden", "verify"], ["golden", "show", "J"]], ids=" ".join)
def test_corrupt_golden_is_one_line_naming_the_file(corrupt_golden, suite_path, capsys, command):
    root, path = corrupt_golden
    capsys.readouterr()
    rc = climod.main([*command, "--suite", str(suite_path), "--goldens", str(root)])
    assert rc == 2
    assert path.name in one_error_line(capsys.readouterr().err)


def test_corrupt_golden_in_a_real_process(corrupt_golden, suite_path, tmp_path):
    root, path = corrupt_golden
    out = run_cli(["golden", "show", "J", "--suite", str(suite_path), "--goldens", str(root)], cwd=tmp_path)
    assert out.returncode == 2
    assert path.name in one_error_line(out.stderr)


# -- the error boundary: which exceptions become one line ----------------------------------------


def _install_command(monkeypatch, name: str, exc: BaseException) -> None:
    """Register a command `name` that raises `exc`, the way LazyGroup finds real ones."""
    module = types.ModuleType(f"diffcheck_test_{name}")

    @click.command(name=name)
    def command():
        raise exc

    setattr(module, name, command)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(climod.COMMANDS, name, (module.__name__, "test command"))


def test_internal_bug_keeps_its_traceback(monkeypatch):
    _install_command(monkeypatch, "boom", ZeroDivisionError("division by zero"))
    with pytest.raises(ZeroDivisionError):
        climod.main(["boom"])


def test_internal_bug_traceback_reaches_stderr():
    code = (
        "import sys, types, click\n"
        "from diffcheck import cli\n"
        "m = types.ModuleType('diffcheck_test_boom')\n"
        "@click.command(name='boom')\n"
        "def boom():\n"
        "    1 / 0\n"
        "m.boom = boom\n"
        "sys.modules[m.__name__] = m\n"
        "cli.COMMANDS['boom'] = (m.__name__, 'raises')\n"
        "sys.exit(cli.main(['boom']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1  # Python's own code for an uncaught exception
    assert "Traceback (most recent call last)" in out.stderr and "ZeroDivisionError" in out.stderr
    assert "diffcheck: error:" not in out.stderr


@pytest.mark.parametrize(("exc", "code"), [
    (ConfigError("cases/x.toml: [cases.J] sampling.top_k: must be an integer"), 2),
    (EngineError("engine failed to start for case 'J': ValueError: no memory"), 3),
    (EngineError("engine failed", exit_code=125), 125),
])
def test_user_errors_map_to_their_exit_codes(monkeypatch, capsys, exc, code):
    _install_command(monkeypatch, "fails", exc)
    assert climod.main(["fails"]) == code
    assert one_error_line(capsys.readouterr().err) == f"diffcheck: error: {exc.message}"


def test_compare_exit_codes_for_an_engine_error_verdict():
    from diffcheck.core.types import exit_code  # what `compare` exits with
    from diffcheck.core.types import Verdict

    assert exit_code(Verdict.ERROR, strict=False, bisect_codes=False) == 3
    assert exit_code(Verdict.ERROR, strict=True, bisect_codes=True) == 125
    assert exit_code(Verdict.GIBBERISH, strict=False, bisect_codes=True) == 1


# -- engine failure: exit 3, one line with the root cause (125 with --bisect-codes) ----------------


@pytest.mark.engine
def test_engine_refusal_is_raised_in_the_parent_with_its_root_cause(suite_path):
    # vLLM validates max_model_len against the model's config before it spawns the
    # engine core, so this fails in seconds, in this process, with no engine to clean up.
    from diffcheck import cases
    from diffcheck.engines import session as sessionmod

    case = cases.load_suite(suite_path).cases["X"]
    with pytest.raises(EngineError) as info:
        sessionmod.open_engine(case)
    assert info.value.exit_code == 3
    message = info.value.message
    assert "\n" not in message
    assert "'X'" in message and "max_model_len" in message


@pytest.mark.engine
def test_engine_failure_in_run_is_one_line_exit_3(tmp_path, suite_path):
    out = run_cli(["run", "X", "--suite", str(suite_path), "--goldens", str(tmp_path / "goldens")], cwd=tmp_path,
                  timeout=300)
    assert out.returncode == 3, out.stderr
    line = final_error_line(out.stderr)
    assert "'X'" in line and "max_model_len" in line


@pytest.fixture
def golden_root(tmp_path) -> Path:
    """A goldens root holding a synthetic golden for J, so `compare X` gets as far as the engine."""
    from diffcheck.storage import store

    root = tmp_path / "goldens"
    store.write_run(store.run_path(root, "errs", "J"), synthetic_run())
    return root


@pytest.mark.engine
def test_engine_failure_in_compare_is_an_error_verdict_exit_3(suite_path, golden_root, capsys):
    # In-process: vLLM is already imported by now, so the refusal costs no start-up.
    rc = climod.main(["compare", "X", "--suite", str(suite_path), "--goldens", str(golden_root)])
    out = capsys.readouterr()
    assert rc == 3, out.out + out.err
    assert "ERROR" in out.out and "max_model_len" in out.out + out.err


@pytest.mark.engine
def test_engine_failure_with_bisect_codes_exits_125(tmp_path, suite_path, golden_root):
    out = run_cli(["compare", "X", "--suite", str(suite_path), "--goldens", str(golden_root), "--bisect-codes"],
                  cwd=tmp_path, timeout=300)
    assert out.returncode == 125, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert not any(noise in out.stderr for noise in ENGINE_NOISE), out.stderr
    assert "ERROR" in out.stdout and "max_model_len" in out.stdout + out.stderr
