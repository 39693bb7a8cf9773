"""The report registry: one output concept for every command (hand-built results, no engine)."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from diffcheck.cli import main
from diffcheck.core.errors import ConfigError
from diffcheck.core.types import Verdict
from diffcheck.report import ReportInput, SequenceTexts, report_input
from diffcheck.report.registry import FORMATS, KINDS, check_outputs, render, write_outputs
from diffcheck.report.results import CheckReport, ComparisonReport, MatrixReport
from diffcheck.workflows.matrix import MatrixResult, Row

from factories import make_run
from test_report import make_case

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ["matrix", "--from-outcomes", str(ROOT / "cases" / "outcomes" / "flash-v100-quality.toml"),
            "--suite", "flash-v100-quality"]


def comparison_report(**kw) -> ComparisonReport:
    return ComparisonReport(ReportInput(verdicts=(make_case(Verdict.IDENTICAL, Verdict.GIBBERISH),),
                                        meta={"suite": "t"}), **kw)


def matrix_report() -> MatrixReport:
    """A matrix of two candidates: O-fp8 (GIBBERISH in one sequence) and S (IDENTICAL)."""
    comparisons = {
        "O-fp8": SimpleNamespace(verdicts=(make_case(Verdict.IDENTICAL, Verdict.GIBBERISH),), candidate=None, goldens={}),
        "S": SimpleNamespace(verdicts=(make_case(Verdict.IDENTICAL, candidate_id="S"),), candidate=None, goldens={}),
    }
    rows = [Row(case_id="O-eager", reference_id=None, verdict="golden", tokens_per_s=12.5, output="abc"),
            Row(case_id="O-fp8", reference_id="O-eager", verdict="GIBBERISH", delta={"engine.kv_cache_dtype": ("auto", "fp8")},
                onset=30, metrics={"digit_ratio": 0.25, "weird_runs": 3}, note="fp8 | e5m2"),
            Row(case_id="S", reference_id="O-eager", verdict="IDENTICAL", same_as=("O-eager",))]
    result = MatrixResult(suite=SimpleNamespace(name="t"), rows=rows, comparisons=comparisons,
                          outcomes={"O-eager": "clean", "O-fp8": "bad", "S": "clean"})
    return MatrixReport(result, strict=False)


# ---------------------------------------------------------------- the registry


def test_every_format_is_registered_once_with_a_suffix_and_renderers_that_exist():
    assert list(FORMATS) == ["terminal", "json", "junit", "html", "markdown"]
    assert {f.suffix for f in FORMATS.values()} == {".txt", ".json", ".xml", ".html", ".md"}
    options = [f.option for f in FORMATS.values() if f.option]
    assert options == ["--json", "--junit", "--html", "--md"]
    for fmt in FORMATS.values():
        for kind in fmt.renders:
            assert kind in KINDS
            assert callable(fmt.renderer(kind)), (fmt.name, kind)


def test_outputs_are_written_where_asked_and_stdout_gets_only_the_document(tmp_path, capsys):
    xml_path, html_path = tmp_path / "deep" / "r.xml", tmp_path / "r.html"
    written = write_outputs({"terminal": "-", "json": "-", "junit": xml_path, "html": html_path, "markdown": None},
                            comparison_report(strict=True, notes=("same output as S",)))
    assert written == [str(xml_path), str(html_path)]
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout holds exactly the JSON document
    assert report["schema"] == "diffcheck.report" and report["verdict"] == "GIBBERISH"
    assert "O-fp8 vs O-eager" in captured.err and captured.err.rstrip().endswith("same output as S")
    suites = ET.parse(xml_path).getroot()
    assert suites.get("name") == "diffcheck" and suites.get("failures") == "1"
    assert html_path.read_text().startswith("<!DOCTYPE html>")
    assert not list(tmp_path.rglob("*.tmp"))


def test_without_a_document_on_stdout_the_terminal_report_goes_there(capsys, tmp_path):
    write_outputs({"terminal": "-", "json": tmp_path / "r.json"}, comparison_report())
    captured = capsys.readouterr()
    assert "case O-fp8: GIBBERISH" in captured.out and captured.err == ""


def test_the_terminal_report_in_a_file_is_plain_text(tmp_path):
    path = tmp_path / "report.txt"
    write_outputs({"terminal": path}, comparison_report())
    text = path.read_text()
    assert "case O-fp8: GIBBERISH" in text and "\x1b" not in text
    assert text == render("terminal", comparison_report())


@pytest.mark.parametrize("outputs, kind, message", [
    ({"markdown": "r.md"}, "comparison",
     "--md: no Markdown report of a comparison (valid here: --json, --junit, --html)"),
    ({"json": "r.json", "junit": "r.xml"}, "outcomes",
     "--junit: no JUnit XML report of recorded outcomes, which hold no verdicts (valid here: --json, --md)"),
    ({"html": "-"}, "selftest", "--html: no HTML report of a self-test (valid here: --json)"),
    ({"json": "-", "html": "-"}, "comparison",
     "--json and --html both go to stdout ('-'): only one output can; give the others a FILE"),
    ({"json": "a/r.json", "html": "a/../a/r.json"}, "comparison",
     "--json and --html both write a/../a/r.json: give each its own FILE"),
])
def test_outputs_that_cannot_be_written_are_one_usage_error(outputs, kind, message):
    with pytest.raises(ConfigError) as info:
        check_outputs(outputs, kind)
    assert info.value.message == message and info.value.exit_code == 2


def test_a_refused_request_writes_nothing(tmp_path):
    with pytest.raises(ConfigError, match="--md: no Markdown report"):
        write_outputs({"json": tmp_path / "r.json", "markdown": tmp_path / "r.md"}, comparison_report())
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- result kinds


def test_report_input_decodes_each_token_with_the_tokenizer_else_uses_whole_texts():
    verdict = make_case(Verdict.BENIGN_DRIFT)  # one sequence, index 0, against O-eager
    comparison = SimpleNamespace(verdicts=(verdict,), candidate=make_run([[7, 8, 9]], texts="cand text"),
                                 goldens={"O-eager": make_run([[7, 5]], texts="ref text")})
    tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    made = report_input(comparison, {"suite": "t"}, tokenizer=tokenizer)
    assert made.texts == {("O-fp8", "O-eager", 0): SequenceTexts(("<7>", "<5>"), ("<7>", "<8>", "<9>"))}
    assert made.meta == {"suite": "t"} and made.speed is None
    whole = report_input(comparison, {}).texts[("O-fp8", "O-eager", 0)]
    assert (whole.reference_text, whole.candidate_text, whole.tokenized) == ("ref text", "cand text", False)
    never_ran = SimpleNamespace(verdicts=(verdict,), candidate=None, goldens={})
    assert report_input(never_ran, {}).texts == {}


def test_the_matrix_json_holds_the_table_and_each_compared_case_report():
    text = render("json", matrix_report())
    doc = json.loads(text)
    assert (doc["schema"], doc["version"], doc["verdict"]) == ("diffcheck.matrix", 1, "GIBBERISH")
    assert doc["meta"] == {"suite": "t", "command": "diffcheck matrix --suite t"}
    assert [r["case"] for r in doc["rows"]] == ["O-eager", "O-fp8", "S"]
    assert doc["rows"][0]["reference"] is None and doc["rows"][0]["tokens_per_s"] == 12.5
    assert doc["rows"][1]["config_delta"] == {"engine.kv_cache_dtype": {"reference": "auto", "candidate": "fp8"}}
    assert doc["rows"][1]["onset"] == 30 and doc["rows"][1]["note"] == "fp8 | e5m2"
    assert doc["rows"][2]["same_as"] == ["O-eager"]
    assert doc["outcomes"] == {"O-eager": "clean", "O-fp8": "bad", "S": "clean"} and doc["narrowing"] is None
    fp8 = doc["reports"]["O-fp8"]
    assert fp8["schema"] == "diffcheck.report" and fp8["verdict"] == "GIBBERISH"
    assert fp8["meta"] == {"suite": "t", "candidate": "O-fp8", "references": ["O-eager"],
                           "command": "diffcheck matrix --suite t"}
    assert [s["verdict"] for s in fp8["cases"][0]["sequences"]] == ["IDENTICAL", "GIBBERISH"]
    assert doc["reports"]["S"]["cases"][0]["candidate_id"] == "S"
    # each series stays on one line inside the nested report, and keeps its values
    series_lines = [line for line in text.splitlines() if '"ref_nll_candidate": [' in line]
    assert len(series_lines) == 3 and all(line.rstrip().endswith(("]", "],")) for line in series_lines)
    sent = make_case(Verdict.IDENTICAL, Verdict.GIBBERISH).sequences[1].series["ref_nll_candidate"]
    assert fp8["cases"][0]["sequences"][1]["series"]["ref_nll_candidate"] == pytest.approx(list(sent))


def test_the_matrix_junit_and_html_cover_every_comparison():
    report = matrix_report()
    suites = ET.fromstring(render("junit", report).split("\n", 1)[1])
    assert suites.get("name") == "diffcheck matrix t"
    assert [s.get("name") for s in suites] == ["O-fp8 vs O-eager", "S vs O-eager"]
    page = render("html", report)
    assert page.count('<details class="seq"') == 3  # 2 sequences of O-fp8, 1 of S


def test_the_check_terminal_report_names_the_goldens_that_moved():
    from diffcheck.workflows.check import GoldenMove

    moves = (GoldenMove("J", Verdict.BENIGN_DRIFT, "vllm 1", "vllm 2", False),
             GoldenMove("K", Verdict.IDENTICAL, "vllm 1", "vllm 1", False))
    report = CheckReport(verdicts=(make_case(Verdict.IDENTICAL),), meta={}, suite="default", suite_option="mine.toml",
                         goldens=moves, skipped=(("E", "tagged slow"),), exit_code=0)
    console = Console(file=io.StringIO(), width=200)
    FORMATS["terminal"].renderer("check")(report, console)
    lines = console.file.getvalue().splitlines()
    assert "left out: E: tagged slow" in lines
    assert "moved: J; benign: J" in lines
    assert "to accept the new engine's goldens: diffcheck golden record J --update --suite mine.toml" in lines
    assert lines[-1] == "check: 1 comparisons, worst IDENTICAL, exit 0"


# ---------------------------------------------------------------- the commands


def test_matrix_outputs_follow_the_convention(capsys, tmp_path):
    assert main([*OUTCOMES, "--json", "-", "--md", str(tmp_path / "m.md")]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["schema"] == "diffcheck.matrix" and doc["verdict"] is None and doc["reports"] == {}
    assert {"A", "B", "C"} <= {r["case"] for r in doc["rows"]}
    assert doc["narrowing"]["lines"][0].startswith("narrowing: 8 bad")
    assert "matrix: suite flash-v100-quality" in captured.err and f"wrote {tmp_path / 'm.md'}" in captured.err
    assert (tmp_path / "m.md").read_text().startswith("# Matrix: suite flash-v100-quality")

    assert main([*OUTCOMES, "--junit", str(tmp_path / "m.xml")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ("diffcheck: error: --junit: no JUnit XML report of recorded "
                                                   "outcomes, which hold no verdicts (valid here: --json, --md)\n")
    assert not (tmp_path / "m.xml").exists()
