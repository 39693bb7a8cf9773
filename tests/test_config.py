"""Project configuration (diffcheck.core.config): [tool.diffcheck] < environment < flags, shipped suites, init."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffcheck import cases as lang
from diffcheck.core import config
from diffcheck.cli import main
from diffcheck.core.errors import ConfigError
from diffcheck import workspace
from factories import write_suite

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p.stem for p in (ROOT / "cases").glob("*.toml"))  # what the repository's cases/ holds


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project folder as the working directory, with no DIFFCHECK_* variables set."""
    for var in config.ENV.values():
        monkeypatch.delenv(var, raising=False)
    folder = tmp_path / "proj"
    folder.mkdir()
    monkeypatch.chdir(folder)
    assert config.find_pyproject(folder) is None, "a pyproject.toml above the temp folder has [tool.diffcheck]"
    return folder


def pyproject(folder: Path, table: str, head: str = '[project]\nname = "x"\n') -> Path:
    path = folder / "pyproject.toml"
    path.write_text(head + "\n[tool.diffcheck]\n" + table)
    return path


def test_defaults_without_a_config(project):
    s = config.load()
    assert (s.cases, s.goldens, s.suite, s.pyproject) == (Path("cases"), Path("goldens"), "default", None)
    assert workspace.goldens_root() == Path("goldens") and lang.cases_dir() == Path("cases")


def test_pyproject_paths_are_relative_to_the_file_from_any_subfolder(project, monkeypatch):
    path = pyproject(project, 'cases = "qa/cases"\ngoldens = "qa/goldens"\nsuite = "smoke"\n')
    (project / "src" / "deep").mkdir(parents=True)
    monkeypatch.chdir(project / "src" / "deep")
    s = config.load()
    assert s.pyproject == path
    assert s.cases == project / "qa" / "cases" and s.goldens == project / "qa" / "goldens" and s.suite == "smoke"
    assert lang.cases_dir() == project / "qa" / "cases"
    assert workspace.goldens_root() == project / "qa" / "goldens"
    assert s.sources == {"cases": str(path), "goldens": str(path), "suite": str(path)}


def test_the_nearest_pyproject_with_the_table_wins(project, monkeypatch):
    pyproject(project, 'goldens = "outer"\n')
    inner = project / "pkg"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "pkg"\n')  # no [tool.diffcheck]: skipped
    monkeypatch.chdir(inner)
    assert config.load().goldens == project / "outer"
    pyproject(inner, 'goldens = "inner"\n')
    assert config.load().goldens == inner / "inner"


def test_environment_beats_pyproject_and_flags_beat_both(project, monkeypatch):
    pyproject(project, 'cases = "c1"\ngoldens = "g1"\nsuite = "s1"\n')
    monkeypatch.setenv("DIFFCHECK_CASES", "c2")
    monkeypatch.setenv("DIFFCHECK_GOLDENS", "g2")
    monkeypatch.setenv("DIFFCHECK_SUITE", "s2")
    s = config.load()
    assert (s.cases, s.goldens, s.suite) == (Path("c2"), Path("g2"), "s2")
    assert s.sources == {"cases": "$DIFFCHECK_CASES", "goldens": "$DIFFCHECK_GOLDENS", "suite": "$DIFFCHECK_SUITE"}
    s = config.load(cases="c3", goldens="g3", suite="s3")
    assert (s.cases, s.goldens, s.suite) == (Path("c3"), Path("g3"), "s3")
    assert workspace.goldens_root("g3") == Path("g3") and workspace.goldens_root() == Path("g2")


@pytest.mark.parametrize("table, names", [
    ('case = "x"\n', "unknown key 'case' (valid: cases, goldens, suite)"),
    ("goldens = 3\n", "goldens must be a non-empty string"),
    ('suite = ""\n', "suite must be a non-empty string"),
])
def test_bad_config_is_one_line_naming_the_file_and_key(project, capsys, table, names):
    path = pyproject(project, table)
    with pytest.raises(ConfigError) as err:
        config.load()
    assert str(err.value).startswith(f"{path}: [tool.diffcheck] ") and names in str(err.value)
    assert main(["cases", "list"]) == 2  # every command refuses it the same way
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"diffcheck: error: {err.value}"]


def test_broken_pyproject_names_the_file(project):
    (project / "pyproject.toml").write_text("[tool.diffcheck\n")
    with pytest.raises(ConfigError, match=r"pyproject\.toml: not valid TOML"):
        config.load()


def test_a_project_suite_shadows_the_shipped_one_and_others_fall_back(project):
    assert config.shipped_suites() == SHIPPED and "default" in SHIPPED
    assert lang.load_suite("gpu-h200").path.resolve() == (ROOT / "cases" / "gpu-h200.toml").resolve()
    own = write_suite(project / "cases", name="default")
    assert lang.load_suite("default").path == Path("cases") / "default.toml"
    assert lang.load_suite().path.resolve() == own.resolve()  # the default suite, by name
    assert lang.load_suite("gpu-h200").path.resolve() == (ROOT / "cases" / "gpu-h200.toml").resolve()


def test_a_missing_suite_names_the_projects_and_the_shipped(project):
    write_suite(project / "cases", name="mine")
    with pytest.raises(ConfigError) as err:
        lang.load_suite("nope")
    assert "no such suite 'nope' (available: mine); diffcheck ships " + ", ".join(SHIPPED) in str(err.value)


def test_cli_suite_default_follows_the_config(project, monkeypatch, capsys):
    write_suite(project / "cases", {"Q": {"role": "reference", "description": "q"}}, name="mine")
    pyproject(project, 'suite = "mine"\n')
    assert main(["cases", "show", "Q", "--json", "-"]) == 0
    assert '"suite": "mine"' in capsys.readouterr().out
    write_suite(project / "cases", {"R": {"role": "reference", "description": "r"}}, name="other")
    monkeypatch.setenv("DIFFCHECK_SUITE", "other")
    assert main(["cases", "show", "R", "--json", "-"]) == 0
    assert '"suite": "other"' in capsys.readouterr().out
    assert main(["cases", "show", "Q", "--suite", "mine", "--json", "-"]) == 0  # the flag wins
    assert '"suite": "mine"' in capsys.readouterr().out


# -- diffcheck init ------------------------------------------------------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_init_scaffolds_a_starter_suite_in_the_repository_root(project, monkeypatch, capsys):
    (project / ".git").mkdir()  # the repository root; init runs from a subfolder
    (project / "pyproject.toml").write_text('[project]\nname = "mine"\n')
    (project / "src").mkdir()
    monkeypatch.chdir(project / "src")
    assert main(["init"]) == 0
    out = capsys.readouterr().out
    assert f"created  {project / 'cases' / 'default.toml'}" in out
    assert (project / "goldens").is_dir() and not (project / "src" / "cases").exists()
    data = tomllib.loads((project / "pyproject.toml").read_text())
    assert data["project"] == {"name": "mine"}  # kept
    assert data["tool"]["diffcheck"] == {"cases": "cases", "goldens": "goldens", "suite": "default"}

    suite = lang.load_suite()  # found from src/ through the new [tool.diffcheck]
    assert suite.path.resolve() == (project / "cases" / "default.toml").resolve()
    refs = [c for c in suite.cases.values() if c.role == "reference"]
    cands = [c for c in suite.cases.values() if c.role == "candidate"]
    assert [c.id for c in refs] == ["J"] and len(cands) == 1 and cands[0].references == ("J",)
    assert {c.model for c in suite.cases.values()} == {"smollm2-135m"}
    prompts = lang.load_prompts(refs[0])
    assert 1 <= len(prompts) <= 4 and all(len(p.text) < 200 for p in prompts)
    assert refs[0].sampling.logprobs and refs[0].sampling.max_tokens <= 64
    assert main(["cases", "check"]) == 0

    before = _tree(project)
    assert main(["init"]) == 0  # a second run changes nothing
    assert _tree(project) == before
    assert "created" not in capsys.readouterr().out.replace("next:", "")


def test_init_creates_a_pyproject_and_never_overwrites_a_suite(project, capsys):
    (project / "cases").mkdir()
    mine = project / "cases" / "default.toml"
    mine.write_text("# my own suite\n")
    assert main(["init"]) == 0
    assert mine.read_text() == "# my own suite\n"
    assert f"exists   {mine}" in capsys.readouterr().out
    assert (project / "cases" / "prompts" / "starter.toml").is_file()
    assert tomllib.loads((project / "pyproject.toml").read_text()) == {
        "tool": {"diffcheck": {"cases": "cases", "goldens": "goldens", "suite": "default"}}}


def test_init_follows_an_existing_config_and_no_config_leaves_pyproject_alone(project):
    pyproject(project, 'cases = "qa/cases"\ngoldens = "qa/goldens"\nsuite = "starter"\n')
    before = (project / "pyproject.toml").read_text()
    assert main(["init", "--no-config"]) == 0
    assert (project / "pyproject.toml").read_text() == before
    assert (project / "qa" / "cases" / "starter.toml").is_file() and (project / "qa" / "goldens").is_dir()
    assert lang.load_suite().name == "starter"


def test_config_import_stays_light():
    code = "import sys, diffcheck.core.config; print(sorted(m for m in ('numpy', 'pyarrow', 'torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
