"""Reports on hand-built verdicts: terminal table, JSON, JUnit, HTML."""

from __future__ import annotations

import io
import json
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from rich.console import Console

from diffcheck.report import (
    ReportInput,
    SequenceTexts,
    case_baselines,
    printable,
    worst_sequence,
)
from diffcheck.report.html import render_html, write_html
from diffcheck.report.plot import DIVERGENCE_COLOUR, NLL_CANDIDATE_COLOUR, NLL_REFERENCE_COLOUR, plot_svg
from diffcheck.report.json_report import VERSION, write_json
from diffcheck.report.junit import write_junit
from diffcheck.report.terminal import make_console, render_divergence, render_table
from diffcheck.core.types import CaseVerdict, SequenceVerdict, Verdict

SCRIPT = "<script>alert('x') & \"q\"</script>"


def make_sequence(index: int, verdict: Verdict, *, n: int = 64, series: dict | None = None, **kw) -> SequenceVerdict:
    t_star = None if verdict is Verdict.IDENTICAL else kw.pop("t_star", 20)
    onset = kw.pop("onset", 30 if verdict is Verdict.GIBBERISH else None)
    rng = np.random.default_rng(index)
    if series is None:
        kl = np.abs(rng.normal(0, 0.01, n))
        if onset is not None:
            kl[onset:] += 3.0
        kl[5] = np.nan
        series = {
            "forced_kl": kl,
            "ref_nll_candidate": np.abs(rng.normal(1.5, 0.5, n)),
            "ref_nll_reference": np.abs(rng.normal(1.5, 0.5, n)),
        }
    defaults = dict(
        index=index,
        prompt_id=f"p{index}",
        verdict=verdict,
        t_star=t_star,
        onset=onset,
        shared_prefix=n if t_star is None else t_star,
        reference_len=n,
        candidate_len=n,
        evidence=(f"{verdict.name.lower()} evidence for seq {index}", "second reason"),
        stats={"kl_p99": 0.5, "same_top1": 0.9, "nan_stat": float("nan")},
        baselines={"exact_match": verdict is Verdict.IDENTICAL, "check_logprobs_close": verdict is not Verdict.GIBBERISH},
        quality={"digit_ratio": 0.25, "weird_runs": 3, "token_count": n, "output_hash": "abc"},
        series=series,
    )
    defaults.update(kw)
    return SequenceVerdict(**defaults)


def make_case(*verdicts: Verdict, candidate_id: str = "O-fp8", **kw) -> CaseVerdict:
    sequences = tuple(make_sequence(i, v) for i, v in enumerate(verdicts))
    return CaseVerdict(
        candidate_id=candidate_id,
        reference_id="O-eager",
        verdict=Verdict.worst(verdicts),
        sequences=sequences,
        config_delta={"engine.kv_cache_dtype": ("auto", "fp8_e5m2")},
        **kw,
    )


ALL = tuple(Verdict)


def plain_console(**kw) -> Console:
    return Console(file=io.StringIO(), width=200, **kw)


# ---------------------------------------------------------------- shared helpers


def test_case_baselines_fail_when_any_sequence_fails_and_none_when_unrecorded():
    case = make_case(Verdict.IDENTICAL, Verdict.GIBBERISH)
    assert case_baselines(case) == {"exact_match": False, "check_logprobs_close": False}
    bare = CaseVerdict("c", "r", Verdict.IDENTICAL, (make_sequence(0, Verdict.IDENTICAL, baselines={}),))
    assert case_baselines(bare) == {"exact_match": None, "check_logprobs_close": None}


def test_worst_sequence_prefers_severity_then_earliest_t_star():
    seqs = (
        make_sequence(0, Verdict.DEGRADED, t_star=3),
        make_sequence(1, Verdict.GIBBERISH, t_star=40, onset=50),
        make_sequence(2, Verdict.GIBBERISH, t_star=10, onset=12),
    )
    case = CaseVerdict("c", "r", Verdict.GIBBERISH, seqs)
    assert worst_sequence(case).index == 2


def test_printable_makes_control_characters_visible():
    assert printable("a\x1b[31mb\x00\n\t\ud800") == "a␛[31mb␀\n\t\ufffd"


def test_report_input_accepts_pairs_and_looks_up_by_case_and_index():
    case = make_case(Verdict.BENIGN_DRIFT)
    report = ReportInput(verdicts=[case], texts={("O-fp8", "O-eager", 0): (["a", "b"], ["a", "c"])})
    texts = report.texts_for(case, case.sequences[0])
    assert texts == SequenceTexts(("a", "b"), ("a", "c"))
    split = texts.split(1)
    assert (split.prefix, split.reference_rest, split.candidate_rest, split.cut_step) == (("a",), ("b",), ("c",), 1)


def test_whole_text_fallback_splits_at_first_differing_character():
    split = SequenceTexts.from_texts("The answer is 42.", "The answer is 41.5").split(7)
    assert split.prefix == ("The answer is 4",)
    assert (split.reference_rest, split.candidate_rest, split.cut_step) == (("2.",), ("1.5",), None)


# ---------------------------------------------------------------- terminal


def test_table_renders_every_verdict_with_footer_and_no_escape_codes():
    cases = [make_case(*ALL), make_case(Verdict.IDENTICAL, candidate_id="O-same")]
    console = render_table(cases, plain_console())
    out = console.file.getvalue()
    for verdict in Verdict:
        assert verdict.name in out
    assert "\x1b[" not in out  # not a terminal: plain text for CI logs
    e = ALL.index(Verdict.ERROR)
    assert f"p{e}" in out and f"error evidence for seq {e}" in out
    assert "exact match would say: FAIL" in out
    assert "check_logprobs_close would say: FAIL" in out
    assert "engine.kv_cache_dtype: 'auto' -> 'fp8_e5m2'" in out
    assert "0.250" in out  # digit_ratio column


def _colour_codes(text: str) -> list[str]:
    codes = []
    for params in re.findall(r"\x1b\[([0-9;]*)m", text):
        codes += [p for p in params.split(";") if p and (30 <= int(p) <= 38 or 90 <= int(p) <= 97)]
    return codes


def test_table_honours_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    coloured = render_table([make_case(*ALL)], plain_console(force_terminal=True)).file.getvalue()
    assert _colour_codes(coloured), "a terminal console should colour verdicts"
    monkeypatch.setenv("NO_COLOR", "1")
    plain = render_table([make_case(*ALL)], plain_console(force_terminal=True)).file.getvalue()
    assert _colour_codes(plain) == []
    assert "GIBBERISH" in plain


def test_console_for_non_terminal_is_wide(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console(file=io.StringIO()).width == 160


def test_error_case_without_sequences_prints_its_error():
    case = CaseVerdict("O-crash", "O-eager", Verdict.ERROR, (), error="engine died: CUDA error")
    out = render_table([case], plain_console()).file.getvalue()
    assert "ERROR" in out and "engine died: CUDA error" in out and "n/a" in out


def test_render_divergence_shows_step_tokens_and_window_of_worst_sequence():
    case = make_case(Verdict.BENIGN_DRIFT, Verdict.GIBBERISH)
    reference = [f"r{i} " for i in range(64)]
    candidate = reference[:20] + [f"c{i} " for i in range(20, 64)]
    out = render_divergence(case, (reference, candidate), console=plain_console(), window=3).file.getvalue()
    assert "seq 1 (p1): GIBBERISH" in out
    assert "step 20: reference token 'r20 ', candidate token 'c20 '" in out
    assert "r17 r18 r19 r20 r21 r22" in out
    assert "r17 r18 r19 c20 c21 c22" in out
    assert "r16" not in out  # the window is 3 tokens before t*
    assert "gibberish evidence for seq 1" in out


def test_render_divergence_of_identical_sequence_says_so():
    out = render_divergence(make_sequence(0, Verdict.IDENTICAL), console=plain_console()).file.getvalue()
    assert "identical" in out and "t*=-" in out


# ---------------------------------------------------------------- JSON


def test_json_round_trips_with_documented_keys(tmp_path):
    path = write_json(tmp_path / "out" / "report.json", [make_case(*ALL)], {"suite": "default", "n": np.int64(3)})
    with open(path) as fh:
        data = json.load(fh, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["schema"] == "diffcheck.report" and data["version"] == VERSION
    assert data["meta"] == {"suite": "default", "n": 3}
    assert data["verdict"] == "ERROR"
    assert data["counts"] == {v.name: 1 for v in Verdict}
    (case,) = data["cases"]
    assert set(case) == {
        "candidate_id", "reference_id", "verdict", "error", "summary", "config_delta", "baselines", "sequences",
    }
    assert case["config_delta"] == {"engine.kv_cache_dtype": {"reference": "auto", "candidate": "fp8_e5m2"}}
    assert case["baselines"] == {"exact_match": False, "check_logprobs_close": False}
    g = ALL.index(Verdict.GIBBERISH)
    sequence = case["sequences"][g]
    assert set(sequence) == {
        "index", "prompt_id", "verdict", "t_star", "onset", "shared_prefix", "reference_len", "candidate_len",
        "evidence", "stats", "baselines", "quality", "series",
    }
    assert (sequence["verdict"], sequence["t_star"], sequence["onset"]) == ("GIBBERISH", 20, 30)
    assert case["sequences"][0]["t_star"] is None
    assert sequence["evidence"][0] == f"gibberish evidence for seq {g}"
    assert sequence["stats"]["nan_stat"] is None
    kl = sequence["series"]["forced_kl"]
    assert len(kl) == 64 and kl[5] is None and isinstance(kl[40], float) and kl[40] > 2.9
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]  # no temp file left


def test_json_overwrites_atomically(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    write_json(path, [make_case(Verdict.IDENTICAL)])
    assert json.loads(path.read_text())["verdict"] == "IDENTICAL"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


# ---------------------------------------------------------------- JUnit


def _junit(tmp_path, cases, **kw):
    root = ET.parse(write_junit(tmp_path / "junit.xml", cases, **kw)).getroot()
    return root, root.findall("testsuite")


def test_junit_counts_failures_errors_and_passing_output(tmp_path):
    cases = [make_case(*ALL), make_case(Verdict.GIBBERISH, Verdict.IDENTICAL, candidate_id="O-b")]
    root, suites = _junit(tmp_path, cases)
    # failures: DEGRADED and GIBBERISH of the first case, GIBBERISH of the second; ERROR is an error;
    # INCONCLUSIVE is skipped (not judged), never passed
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == (
        str(len(ALL) + 2), "3", "1", "1")
    assert [s.get("name") for s in suites] == ["O-fp8 vs O-eager", "O-b vs O-eager"]
    testcases = suites[0].findall("testcase")
    assert [t.get("name") for t in testcases] == [f"seq{i} p{i}" for i in range(len(ALL))]
    by_verdict = dict(zip(Verdict, testcases))
    for v, outcome in ((Verdict.GIBBERISH, "failure"), (Verdict.DEGRADED, "failure"), (Verdict.ERROR, "error"),
                       (Verdict.INCONCLUSIVE, "skipped")):
        child = by_verdict[v].find(outcome)
        assert child.get("message") == f"{v.name.lower()} evidence for seq {ALL.index(v)}" and child.get("type") == v.name
    assert by_verdict[Verdict.INCONCLUSIVE].find("failure") is None
    assert suites[0].get("skipped") == "1"
    budget = by_verdict[Verdict.WITHIN_BUDGET]
    assert budget.find("failure") is None and "within_budget evidence" in budget.find("system-out").text
    assert list(by_verdict[Verdict.IDENTICAL]) == []
    props = {p.get("name"): p.get("value") for p in suites[0].iter("property")}
    assert props["verdict"] == "ERROR" and props["config_delta.engine.kv_cache_dtype"] == "'auto' -> 'fp8_e5m2'"


def test_junit_strict_fails_a_precision_cost(tmp_path):
    root, _ = _junit(tmp_path, [make_case(Verdict.WITHIN_BUDGET, Verdict.BENIGN_DRIFT)], strict=True)
    assert root.get("failures") == "1"
    assert root.find(".//failure").get("type") == "WITHIN_BUDGET"
    root, _ = _junit(tmp_path, [make_case(Verdict.WITHIN_BUDGET, Verdict.BENIGN_DRIFT)])
    assert root.get("failures") == "0"


def test_junit_engine_error_without_sequences_and_control_characters(tmp_path):
    crash = CaseVerdict("O-crash", "O-eager", Verdict.ERROR, (), error="worker died \x1b[31mred\x00")
    root, (suite,) = _junit(tmp_path, [crash])
    assert (root.get("tests"), root.get("errors")) == ("1", "1")
    error = suite.find("testcase/error")
    assert suite.find("testcase").get("name") == "engine" and error.get("message") == "worker died ␛[31mred␀"


# ---------------------------------------------------------------- HTML


def _report(*verdicts, texts=None) -> ReportInput:
    return ReportInput(verdicts=[make_case(*verdicts)], texts=texts or {}, meta={"suite": "default"})


def test_html_has_svg_with_a_path_per_curve_and_markers(tmp_path):
    text = write_html(tmp_path / "r.html", _report(Verdict.GIBBERISH)).read_text()
    (svg,) = re.findall(r"<svg.*?</svg>", text, re.S)
    curves = re.findall(r'<path d="M[^"]+" class="curve ([^"]+)" stroke="([^"]+)"', svg)
    assert curves == [
        ("divergence", DIVERGENCE_COLOUR),
        ("ref-nll-candidate", NLL_CANDIDATE_COLOUR),
        ("ref-nll-reference", NLL_REFERENCE_COLOUR),
    ]
    assert "t*=20" in svg and "onset=30" in svg and "KL, forced on reference tokens" in svg
    assert ">step<" in svg


def test_html_prefers_forced_series_and_skips_empty_or_all_nan_curves():
    n = 40
    series = {
        "kl": np.full(n, 7.0),
        "forced_kl": np.linspace(0, 1, n),
        "ref_nll_candidate": np.full(n, np.nan),
        "ref_nll_reference": np.array([]),
    }
    svg = plot_svg(make_sequence(0, Verdict.DEGRADED, n=n, series=series))
    assert svg.count('class="curve') == 1 and "forced on reference tokens" in svg
    assert "NLL" not in svg
    assert plot_svg(make_sequence(0, Verdict.DEGRADED, series={})) == ""
    html = render_html(_report(Verdict.IDENTICAL))
    assert "<svg" in html  # identical sequences still get their curves


def test_html_breaks_curve_at_nan_and_keeps_spikes_when_decimating():
    n = 100_000
    kl = np.zeros(n)
    kl[50_000] = 100.0
    kl[10] = np.nan
    svg = plot_svg(make_sequence(0, Verdict.GIBBERISH, n=n, series={"forced_kl": kl}, onset=50_000))
    (d,) = re.findall(r'<path d="([^"]+)" class="curve divergence"', svg)
    assert d.count("M") == 2  # one gap at the NaN
    ys = [float(y) for y in re.findall(r"[\d.]+,([\d.]+)", d)]
    assert len(ys) < 2000  # decimated: about two points per 2-pixel bucket
    assert min(ys) < 28 + 10  # the spike reaches the top of the panel (panel top 28, 5% headroom)


def test_html_escapes_all_run_text_and_loads_nothing_external():
    case = CaseVerdict(
        candidate_id=f"O{SCRIPT}",
        reference_id="O-eager",
        verdict=Verdict.GIBBERISH,
        sequences=(make_sequence(
                0, Verdict.GIBBERISH, t_star=2, onset=10, prompt_id=SCRIPT, evidence=(SCRIPT,), quality={"x": SCRIPT}
            ),),
        config_delta={"engine.x": (SCRIPT, "b")},
    )
    reference = ["Hello", " world", SCRIPT] + ["."] * 61
    candidate = ["Hello", " world", "<b>&amp;</b>"] + [SCRIPT] * 61
    html = render_html(ReportInput([case], {(case.candidate_id, "O-eager", 0): (reference, candidate)}, {"m": SCRIPT}))
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;) &amp; &quot;q&quot;&lt;/script&gt;" in html
    assert "&lt;b&gt;&amp;amp;&lt;/b&gt;" in html
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html)
    assert "<link" not in html and "@import" not in html


def test_html_texts_highlight_divergence_and_onset():
    n = 64
    reference = [f"r{i} " for i in range(n)]
    candidate = reference[:20] + [f"c{i} " for i in range(20, n)]
    html = render_html(_report(Verdict.GIBBERISH, texts={("O-fp8", "O-eager", 0): (reference, candidate)}))
    assert "shared prefix (20 tokens)" in html
    reference_side, candidate_side = re.findall(r'<pre class="text (?:ref|cand)">(.*?)</pre>', html, re.S)
    assert '<span title="step 20">r20 </span>' in reference_side
    assert '<span title="step 30">r30 </span>' in reference_side  # the onset is the candidate's alone
    assert '<span title="step 29">c29 </span>' in candidate_side
    assert '<span class="g" title="step 30">c30 </span>' in candidate_side
    assert 'title="step 19"' not in html  # the prefix is plain
    assert "r19 </span>" in reference_side and "r19 </span>" in candidate_side  # its tail leads each side


def test_html_texts_show_start_and_onset_windows_of_long_divergence():
    n = 2000
    reference = [f"r{i} " for i in range(n)]
    candidate = reference[:100] + [f"c{i} " for i in range(100, n)]
    sequence = make_sequence(0, Verdict.GIBBERISH, n=n, t_star=100, onset=1000)
    case = CaseVerdict("c", "r", Verdict.GIBBERISH, (sequence,))
    html = render_html(ReportInput([case], {("c", "r", 0): (reference, candidate)}))
    for side, token in (("ref", "r"), ("cand", "c")):
        (text,) = re.findall(rf'<pre class="text {side}">(.*?)</pre>', html, re.S)
        steps = [int(s) for s in re.findall(r'title="step (\d+)"', text)]
        assert steps == list(range(100, 300)) + list(range(980, 1200)), side
        assert "… 680 tokens …" in text and "… 800 more tokens" in text
        assert f"{token}980 " in text


def test_html_whole_text_fallback_and_missing_texts():
    texts = {("O-fp8", "O-eager", 0): SequenceTexts.from_texts("The answer is 42.", "The answer is 41.5")}
    html = render_html(_report(Verdict.BENIGN_DRIFT, Verdict.DEGRADED, texts=texts))
    assert "shared prefix (15 characters)" in html and '<span class="div">1.5</span>' in html
    assert "No texts were given for this sequence." in html  # seq 1 has no entry


def test_html_summary_links_every_sequence_and_stays_small():
    html = render_html(_report(*ALL))
    for i in range(len(ALL)):
        assert f'href="#c0-s{i}"' in html and f'id="c0-s{i}"' in html
    assert html.index('id="c0-s5"') < html.index('id="c0-s4"') < html.index('id="c0-s0"')  # worst first
    assert len(html.encode()) < 150_000


def test_json_series_compact_float32_exact_and_optional(tmp_path):
    values = np.array([0.1, np.nan, np.inf, 2.5], dtype=np.float32)
    case = CaseVerdict("c", "r", Verdict.DEGRADED, (make_sequence(0, Verdict.DEGRADED, series={"kl": values}),))
    text = write_json(tmp_path / "r.json", [case]).read_text()
    assert '"kl": [0.1,null,null,2.5]' in text  # one line, float32's shortest form
    kl = json.loads(text)["cases"][0]["sequences"][0]["series"]["kl"]
    assert np.float32(kl[0]) == values[0] and kl[1:3] == [None, None]
    small = json.loads(write_json(tmp_path / "s.json", [case], include_series=False).read_text())
    assert small["cases"][0]["sequences"][0]["series"] == {}
    assert json.loads(write_json(tmp_path / "c.json", [case], indent=None).read_text())["cases"][0]["verdict"] == (
        "DEGRADED"
    )


# ---------------------------------------------------------------- speed (runs' timings)

H200 = {"gpu_name": "NVIDIA H200", "cpu_model": "Xeon"}


def _speed_runs():
    from factories import make_run

    def eff(backend, graph):
        return {"effective": {"attention_backend": backend, "cudagraph_mode": graph, "dtype": "bfloat16"}}

    golden = make_run(lengths=(256, 256, 256, 256), case_id="J", engine=eff("TRITON_ATTN", "NONE"), hardware=H200,
                      timings={"startup_s": 47.6, "generate_s": 15.11, "generate_tokens": 1024})
    cand = make_run(lengths=(256, 256, 256, 256), case_id="O", role="candidate", hardware=H200,
                    engine=eff("TRITON_ATTN", "FULL_DECODE_ONLY"),
                    timings={"startup_s": 75.3, "generate_s": 1.024, "generate_tokens": 1024})
    forced = make_run(lengths=(256, 256, 256, 256), case_id="O", role="candidate", kind="forced", hardware=H200,
                      timings={"force_s": 0.5, "force_tokens": 400, "generate_s": 1.024},
                      source={"reference": "J", "replay": "partial", "replayed": [1, 3], "reused": [0, 2]})
    return golden, cand, forced


def test_speed_summary_from_run_timings():
    from diffcheck.report.speed import speed_summary

    golden, cand, forced = _speed_runs()
    speed = speed_summary(cand, {"J": golden}, {"J": forced})
    c, j = speed["runs"]
    assert (c["role"], c["case"], c["generate_tokens"]) == ("candidate", "O", 1024)
    assert c["decode_tokens_per_s"] == pytest.approx(1000.0) and j["decode_tokens_per_s"] == pytest.approx(1024 / 15.11)
    assert c["engine"] == "TRITON_ATTN, FULL_DECODE_ONLY, bfloat16" and c["hardware"] == "NVIDIA H200"
    (f,) = c["forced"]
    assert (f["replay"], f["forced_tokens"], f["path_steps"]) == ("partial", 400, 1024)
    assert f["forced_tokens_per_s"] == pytest.approx(800.0) and f["replayed"] == [1, 3]
    (ratio,) = speed["ratios"]
    assert ratio["decode_speedup"] == pytest.approx(1000.0 / (1024 / 15.11)) and ratio["same_hardware"] is True
    assert speed_summary(None, {"J": golden}) is None


def test_speed_summary_without_timings_or_on_other_hardware():
    from diffcheck.report.speed import speed_lines, speed_summary
    from factories import make_run

    golden, cand, _ = _speed_runs()
    bare = make_run(lengths=(3,), case_id="X", role="candidate")  # no timings recorded
    speed = speed_summary(bare, {"J": golden})
    assert speed["runs"][0]["decode_tokens_per_s"] is None and speed["ratios"][0]["decode_speedup"] is None
    assert "candidate X (?; ?): no timings recorded" in speed_lines(speed)[0]
    other = make_run(lengths=(256,), case_id="J", hardware={"cpu_model": "EPYC"},
                     timings={"generate_s": 30.0, "generate_tokens": 256})
    lines = speed_lines(speed_summary(cand, {"J": other}))
    assert lines[-1] == "O decodes 117.19x as fast as J (different hardware: not comparable)"


def test_speed_in_json_html_and_terminal(tmp_path):
    from diffcheck.report.speed import speed_summary
    from diffcheck.report.terminal import render_speed

    golden, cand, forced = _speed_runs()
    speed = speed_summary(cand, {"J": golden}, {"J": forced})
    data = json.loads(write_json(tmp_path / "r.json", [make_case(Verdict.IDENTICAL)], speed=speed).read_text())
    assert data["speed"]["runs"][0]["decode_tokens_per_s"] == pytest.approx(1000.0)
    assert data["speed"]["ratios"][0]["decode_speedup"] == pytest.approx(14.756, rel=1e-3)
    assert json.loads(write_json(tmp_path / "n.json", [make_case(Verdict.IDENTICAL)]).read_text())["speed"] is None
    html = render_html(ReportInput(verdicts=(make_case(Verdict.IDENTICAL),), speed=speed))
    section = html[html.index('<section id="speed">'):html.index('<section id="sequences">')]
    assert "<td>1000</td>" in section and "<td>68</td>" in section  # decode tok/s, candidate then reference
    assert "<b>O</b> decodes <b>14.76x</b> as fast as <b>J</b>" in section
    assert "J (partial): 400/1024 steps, 0.5 s, 800 tok/s" in section
    assert 'id="speed"' not in render_html(ReportInput(verdicts=(make_case(Verdict.IDENTICAL),)))
    out = render_speed(speed, console=plain_console()).file.getvalue()
    assert "candidate O (TRITON_ATTN, FULL_DECODE_ONLY, bfloat16; NVIDIA H200): 1024 tokens in 1.02 s = 1000 tok/s" in out
    assert "forced along J (partial): 400 of 1024 steps in 0.50 s = 800 tok/s" in out
    assert "O decodes 14.76x as fast as J" in out
