"""`diffcheck cases list|show|check` through click's CliRunner and through `main` (exit codes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffcheck.cli import cli, main

from factories import write_suite

CASES = Path(__file__).resolve().parents[1] / "cases"


@pytest.fixture(autouse=True)
def shipped_cases(monkeypatch):
    monkeypatch.setenv("DIFFCHECK_CASES", str(CASES))


def make_suite(folder: Path, name: str, engine: dict | None = None) -> Path:
    """Two cases: reference J (eager) and candidate O (compiled, plus `engine`)."""
    return write_suite(folder, {
        "J": {"role": "reference", "description": "eager reference", "engine": {"enforce_eager": True}},
        "O": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "compiled",
              "engine": {"enforce_eager": False, **(engine or {"max_num_seqs": 2})}},
    }, name=name, description="tiny", model="m", prompts=[{"id": "a", "text": "hello"}])


def invoke(*args):
    """Run like `main` does (standalone_mode=False) so the command's int is the exit code."""
    return CliRunner().invoke(cli, list(args), standalone_mode=False)


def test_list_all_suites():
    result = invoke("cases", "list")
    assert result.exception is None and result.return_value == 0, result.output
    for text in ("default", "flash-v100-quality", "gpu-h200", "stale", "candidate"):
        assert text in result.output


def test_list_one_suite_by_path(tmp_path):
    path = make_suite(tmp_path, "tiny")
    result = invoke("cases", "list", "--suite", str(path))
    assert result.return_value == 0
    assert "eager reference" in result.output and "compiled" in result.output
    assert "default" not in result.output


def test_show_prints_resolved_config_and_delta():
    result = invoke("cases", "show", "O", "--suite", "flash-v100-quality")
    assert result.exception is None and result.return_value == 0, result.output
    out = result.output
    assert "[engine]" in out and 'attention_backend = "FLASH_ATTN_V100"' in out
    assert "difference from J" in out and "difference from F" in out
    assert "engine.enforce_eager" in out and "engine.cudagraph_mode" in out
    assert "O <- H <- [defaults]" in out


def test_show_defaults_to_the_default_suite():
    result = invoke("cases", "show", "E")
    assert result.return_value == 0
    assert "env.DIFFCHECK_FAULT" in result.output and "stale-decode-metadata" in result.output


def test_show_json():
    result = invoke("cases", "show", "O", "--suite", "flash-v100-quality", "--json", "-")
    assert result.return_value == 0
    data = json.loads(result.output)
    assert data["deltas"]["J"]["engine.enforce_eager"] == [True, False]
    assert data["resolved"]["engine"]["max_model_len"] == 8192
    assert data["expect"] == {"not_verdict": ["GIBBERISH"]} and len(data["digest"]) == 64


def test_show_unknown_case_is_one_line_exit_2(capsys):
    assert main(["cases", "show", "NOPE"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffcheck: error: ") and len(err.strip().splitlines()) == 1
    assert "no case 'NOPE'" in err and "valid: B16" in err


def test_check_all_shipped_suites():
    result = invoke("cases", "check")
    assert result.return_value == 0, result.output
    lines = result.output.strip().splitlines()
    assert any(line.startswith("ok ") and "flash-v100-quality.toml: 19 cases" in line for line in lines)
    assert len(lines) == len(list(CASES.glob("*.toml")))  # one line per shipped suite


def test_check_by_path_and_name(tmp_path):
    result = invoke("cases", "check", str(CASES / "flash-v100-quality.toml"), "gpu-h200")
    assert result.return_value == 0
    assert "flash-v100-quality.toml: 19 cases" in result.output and "gpu-h200.toml: 7 cases" in result.output


def test_check_reports_each_bad_suite_and_exits_2(tmp_path, capsys):
    good = make_suite(tmp_path, "good")
    bad = make_suite(tmp_path, "bad", engine={"cuda_graph": "FULL"})
    assert main(["cases", "check", str(good), str(bad)]) == 2
    captured = capsys.readouterr()
    assert "ok " in captured.out and "good.toml: 2 cases" in captured.out
    assert captured.err.count("diffcheck: error: ") == 1
    assert "case 'O': unknown key 'engine.cuda_graph' (valid: api_key_env, attention_backend, base_url" in captured.err


def test_check_without_suites_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFCHECK_CASES", str(tmp_path / "empty"))
    assert main(["cases", "check"]) == 2
    assert "no suites" in capsys.readouterr().err


def test_golden_record_of_a_suite_whose_references_all_need_naming_says_so(tmp_path, capsys):
    suite = write_suite(tmp_path, {
        "G": {"role": "reference", "description": "a GPU reference", "tags": ["gpu"]},
        "S": {"role": "reference", "description": "a slow reference", "tags": ["slow"]},
    }, name="tagged", description="tiny", model="m", prompts=[{"id": "a", "text": "hello"}])
    assert main(["golden", "record", "--suite", str(suite), "--goldens", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffcheck: error: ") and len(err.strip().splitlines()) == 1
    assert "every reference is tagged slow or gpu" in err and "diffcheck golden record G" in err
    assert not (tmp_path / "g").exists()  # refused before anything is written


def test_the_commands_leave_out_the_same_tags():
    from diffcheck import cases
    from diffcheck.workflows import check, matrix, selftest

    suite = cases.load_suite("gpu-h200")
    tagged = {c.id for c in suite.cases.values() if {"slow", "gpu"} & set(c.tags)}
    assert tagged  # the GPU suite's cases are tagged gpu
    assert {c for c, _ in check.plan(suite)[1]} >= tagged
    assert set(matrix.plan(suite).left_out) == tagged
    assert not {c.id for c in selftest.labelled_cases(suite)} & tagged
