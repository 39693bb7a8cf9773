"""Cross-hardware scoring: `diffcheck compare CASE --run FILE` of a run recorded on a GPU this
machine lacks, with no scored file beside it (issue 21).

The reference's model scores the run on this machine's CPU in float32 (`session.on_this_cpu`),
and the golden's own tokens on the same engine: the judge sets the scored NLL only against that
baseline (`classify.compare_runs`, ``scored_reference``), never against the GPU golden's own
logprobs. The scored runs, the output and the report say where the scoring came from.

The cheap tests here need no engine. The engine test re-judges the committed H200 recordings H
(the seq-lens-copy fault under a FULL CUDA graph, GIBBERISH) and O (the same graph, clean) with
their forced and scored files removed, in a copy (nothing is written into the checkout), with
one engine start for both: the workflow scores them, then the documented command re-judges them
from what was stored, with every engine start made an error.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from diffcheck import cases, workspace
from diffcheck.cases import engine_kinds
from diffcheck.core.errors import DataError, EngineError
from diffcheck.core.types import Run, Verdict
from diffcheck.engines import session as sessionmod
from diffcheck.judging import classify
from diffcheck.storage import store
from diffcheck.workflows import compare as comparemod
from diffcheck.workflows import cross_hardware as xhw

ROOT = Path(__file__).resolve().parent.parent
SUITE_FILE = ROOT / "cases" / "gpu-h200.toml"
SUITE = cases.load_suite(SUITE_FILE)
GOLDENS = ROOT / "goldens" / SUITE.name
PASSING = {"IDENTICAL", "BENIGN_DRIFT"}


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")}


def _copy(tmp_path: Path, *, without: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """The suite file, its prompts and goldens/gpu-h200 in `tmp_path`, less the forced and scored
    files of the candidates in `without`: (suite file, goldens root)."""
    cases_dir = tmp_path / "cases"
    (cases_dir / "prompts").mkdir(parents=True)
    shutil.copy(SUITE_FILE, cases_dir / SUITE_FILE.name)
    prompts = SUITE.cases["J"].prompts_file
    shutil.copy(prompts, cases_dir / "prompts" / prompts.name)
    root = tmp_path / "goldens"
    shutil.copytree(GOLDENS, root / SUITE.name)
    for cid in without:
        for path in (root / SUITE.name).glob(f"{cid}.*-*.parquet"):
            if path.name.startswith((f"{cid}.forced-", f"{cid}.scored-")):
                path.unlink()
    return cases_dir / SUITE_FILE.name, root


def _with_meta(run: Run, **changes) -> Run:
    return dataclasses.replace(run, meta=dataclasses.replace(run.meta, **changes))


# -- the scoring engine's configuration ---------------------------------------------------------------


@pytest.mark.parametrize("cid", ["J", "F", "O", "H", "L"])
def test_the_cpu_scorer_keeps_the_model_and_drops_what_belongs_to_the_gpu(cid):
    case = SUITE.cases[cid]
    local = sessionmod.on_this_cpu(case)
    e = local.engine
    assert (e.kind, e.dtype, e.enforce_eager) == ("vllm", "float32", True)
    assert e.attention_backend is None and e.cudagraph_mode is None and e.compile_mode is None
    assert e.quantization is None and e.kv_cache_dtype is None and e.tensor_parallel_size is None and not e.extra
    assert local.env == {}  # the GPU image's workarounds, and never a fault
    # what defines the numbers and the tokens stays
    assert (local.id, local.model, local.prompts_file, local.sampling) == (case.id, case.model, case.prompts_file,
                                                                          case.sampling)
    assert (e.max_model_len, e.seed) == (case.engine.max_model_len, case.engine.seed)
    assert engine_kinds.check_config(dataclasses.asdict(e), local.env) is None
    assert case.engine.dtype == "bfloat16"  # what the GPU ran


def test_references_that_differ_only_in_gpu_settings_score_on_one_cpu_configuration():
    j, f = (sessionmod.on_this_cpu(SUITE.cases[r]) for r in ("J", "F"))
    assert SUITE.cases["J"].engine.attention_backend != SUITE.cases["F"].engine.attention_backend
    assert sessionmod.config_key(j) == sessionmod.config_key(f)


# -- the label --------------------------------------------------------------------------------------


def test_the_note_says_where_the_scoring_came_from_and_for_which_golden():
    from diffcheck.engines.base import hardware

    golden = store.read_run(GOLDENS / "J.parquet")
    scored = store.read_run(GOLDENS / "O.scored-J.parquet")
    here = {k: v for k, v in hardware().items() if k not in ("gpu_name", "gpu_count", "cuda")}
    stamp = {"golden_hardware": "NVIDIA H200", "dtype": "float32", "scored": "candidate"}
    mine = _with_meta(scored, hardware=here, source={**scored.meta.source, xhw.CROSS_HARDWARE: stamp})
    assert xhw.note(mine, golden) == \
        "scored on this machine's CPU (float32) for a golden recorded on NVIDIA H200"
    other = _with_meta(mine, hardware={"machine": "x86_64", "cpu_model": "Some Other CPU"})
    assert xhw.note(other, golden).startswith(
        "scored on a CPU (Some Other CPU) (float32) for a golden recorded on NVIDIA H200")
    moved = _with_meta(mine, model={**mine.meta.model, "digest": "f" * 64})
    assert xhw.note(moved, golden).endswith(
        f"; model digest {'f' * 12} for the scoring, {golden.meta.model['digest'][:12]} in the golden")


# -- the judge: the baseline comes from the scoring engine --------------------------------------------


def _shifted(run: Run, nats: float) -> Run:
    """`run` as a scoring engine whose NLLs sit `nats` higher would give it (kind "scored")."""
    steps = dataclasses.replace(run.steps, logprob=(run.steps.logprob - nats).astype(run.steps.logprob.dtype))
    return _with_meta(dataclasses.replace(run, steps=steps), kind="scored")


@pytest.fixture(scope="module")
def recorded_o():
    golden = store.read_run(GOLDENS / "J.parquet")
    candidate = store.read_run(GOLDENS / "O.run.parquet")
    scored = store.read_run(GOLDENS / "O.scored-J.parquet")
    floor, _ = workspace.load_floor(ROOT / "goldens", SUITE.name, "J", golden, candidate=candidate)
    return golden, candidate, scored, floor


def test_a_scorer_that_reads_every_text_higher_is_judged_against_its_own_reading_of_the_golden(recorded_o):
    """A shift of 3 nats per token (far beyond bf16 against float32: hundredths of a nat per sequence,
    docs/gpu.md) against the GPU golden's own NLL calls clean text garbage; against the same
    engine's reading of the golden it does not."""
    golden, candidate, scored, floor = recorded_o
    mixed = classify.compare_runs(golden, candidate, scored=_shifted(scored, 3.0), floor=floor)
    assert Verdict.GIBBERISH in {s.verdict for s in mixed.sequences}
    same = classify.compare_runs(golden, candidate, scored=_shifted(scored, 3.0),
                                 scored_reference=_shifted(golden, 3.0), floor=floor)
    assert not {s.verdict for s in same.sequences} & {Verdict.GIBBERISH, Verdict.DEGRADED}
    assert same.summary["signals"]["scored_reference"] is True
    plain = classify.compare_runs(golden, candidate, scored=scored, floor=floor)
    assert [s.verdict for s in same.sequences] == [s.verdict for s in plain.sequences]
    for s, p in zip(same.sequences, plain.sequences):
        assert s.stats["ref_nll_reference_recorded_mean"] == pytest.approx(p.stats["ref_nll_reference_mean"])
        assert s.stats["ref_nll_reference_mean"] == pytest.approx(p.stats["ref_nll_reference_mean"] + 3.0, abs=1e-3)
        assert np.allclose(s.series["ref_nll_reference"], p.series["ref_nll_reference"] + 3.0, atol=1e-3)


def test_a_scored_reference_must_score_the_reference_and_come_with_a_scored_candidate(recorded_o):
    golden, candidate, scored, floor = recorded_o
    with pytest.raises(DataError, match="baseline of a scored candidate"):
        classify.compare_runs(golden, candidate, scored_reference=_shifted(golden, 0), floor=floor)
    with pytest.raises(DataError, match="scored reference run sequence"):
        classify.compare_runs(golden, candidate, scored=scored, scored_reference=_shifted(candidate, 0), floor=floor)


# -- the workflow, with no engine -----------------------------------------------------------------------


def test_a_scoring_engine_that_fails_is_an_error_of_that_comparison(tmp_path, monkeypatch):
    suite_file, root = _copy(tmp_path, without=("H",))
    calls = []

    def failing(case, run, **kw):
        calls.append((case.id, case.engine.dtype, run.meta.case_id))
        raise EngineError("the engine died")

    monkeypatch.setattr(sessionmod, "score", failing)
    lines: list[str] = []
    comparison = comparemod.compare(cases.load_suite(suite_file), "H", root=root,
                                    run_file=root / SUITE.name / "H.run.parquet", echo=lines.append)
    assert calls == [("J", "float32", "H")]
    assert comparison.verdict is Verdict.ERROR
    assert "scoring with reference J failed: the engine died" in comparison.verdicts[0].error
    assert any("recorded on NVIDIA H200" in line and "this machine's CPU" in line for line in lines), lines
    assert not (root / SUITE.name / "H.scored-J.parquet").exists()


def test_a_scoring_recorded_with_another_run_is_never_overwritten(tmp_path):
    _, root = _copy(tmp_path)
    path = root / SUITE.name / "O.scored-J.parquet"
    before = path.read_bytes()
    other = _with_meta(store.read_run(GOLDENS / "H.run.parquet"), case_id="O")  # another run of case O
    fake = _with_meta(store.read_run(GOLDENS / "H.scored-J.parquet"),
                      source={xhw.CROSS_HARDWARE: {"golden_hardware": "NVIDIA H200", "dtype": "float32"}})
    lines: list[str] = []
    kept = xhw.store_here(root, "J", other, fake, echo=lines.append)
    assert path.read_bytes() == before
    assert kept.meta.source["scored_digest"] == store.content_digest(other)
    assert any("holds a scoring made on NVIDIA H200: left as it is" in line for line in lines), lines


# -- the real engine: one start, H and O -----------------------------------------------------------------


@pytest.fixture(scope="module")
def rejudged(tmp_path_factory):
    """H and O without forced or scored files: scored by the workflow on one engine, then re-judged by
    the documented command from what was stored, with engine starts made an error."""
    from diffcheck.cli import main

    before = _snapshot(GOLDENS)
    suite_file, root = _copy(tmp_path_factory.mktemp("xh"), without=("H", "O"))
    suite = cases.load_suite(suite_file)
    starts = []
    mp = pytest.MonkeyPatch()
    real_open = sessionmod.open_engine

    def counting(case, **kw):
        starts.append((case.id, case.engine.dtype, case.engine.cudagraph_mode, dict(case.env)))
        return real_open(case, **kw)

    out: dict = {"starts": starts, "root": root, "lines": {}}
    try:
        mp.setattr(sessionmod, "open_engine", counting)
        with sessionmod.EngineSession() as session:
            for cid in ("H", "O"):
                lines: list[str] = []
                out[cid] = comparemod.compare(suite, cid, root=root, run_file=root / SUITE.name / f"{cid}.run.parquet",
                                              echo=lines.append, session=session)
                out["lines"][cid] = lines

        def no_engine(case, **kw):
            raise AssertionError(f"an engine was started for {case.id}: the stored scorings should serve")

        mp.setattr(sessionmod, "open_engine", no_engine)
        for cid in ("H", "O"):
            report = root.parent / f"{cid}.json"
            code = main(["compare", cid, "--suite", str(suite_file), "--goldens", str(root),
                         "--run", str(root / SUITE.name / f"{cid}.run.parquet"), "--json", str(report)])
            out[f"{cid}.cli"] = (code, json.loads(report.read_text()))
    finally:
        mp.undo()
    assert _snapshot(GOLDENS) == before, "the comparison wrote into the checkout"
    return out


def _sequences(report: dict) -> list[dict]:
    return [s for c in report["cases"] for s in c["sequences"]]


@pytest.mark.engine
def test_one_cpu_engine_in_float32_scores_both_runs_and_the_golden(rejudged):
    assert rejudged["starts"] == [("J", "float32", None, {})]
    folder = rejudged["root"] / SUITE.name
    for name, what in (("H.scored-J.parquet", "candidate"), ("O.scored-J.parquet", "candidate"),
                       ("J.scored-J.parquet", "golden")):
        meta = store.read_meta(folder / name)
        assert meta.kind == "scored" and "gpu_name" not in meta.hardware, name
        assert meta.source[xhw.CROSS_HARDWARE] == {"golden_hardware": "NVIDIA H200", "dtype": "float32",
                                                           "scored": what}, name
        assert meta.engine["effective"]["dtype"] == "float32" and meta.engine["effective"]["enforce_eager"], name
    for cid in ("H", "O"):
        c = rejudged[cid]
        assert set(c.scored) == set(c.scored_reference) == {"J"} and not c.forced
        assert c.scored_reference["J"].meta.source["scored_digest"] == store.content_digest(c.goldens["J"])


@pytest.mark.engine
def test_the_fault_is_still_gibberish_from_its_first_decode_steps(rejudged):
    for seqs in ([{"verdict": s.verdict.name, "onset": s.onset} for s in rejudged["H"].verdicts[0].sequences],
                 _sequences(rejudged["H.cli"][1])):
        assert [s["verdict"] for s in seqs] == ["GIBBERISH"] * 4
        assert all(s["onset"] in (1, 2) for s in seqs), [s["onset"] for s in seqs]
    assert rejudged["H.cli"][0] == 1
    assert SUITE.cases["H"].expect.matches(Verdict.GIBBERISH, 1)


@pytest.mark.engine
def test_the_clean_graph_is_never_garbage_nor_degraded(rejudged):
    for verdicts in ([s.verdict.name for s in rejudged["O"].verdicts[0].sequences],
                     [s["verdict"] for s in _sequences(rejudged["O.cli"][1])]):
        assert len(verdicts) == 4
        assert set(verdicts) <= PASSING | {"INCONCLUSIVE"}, verdicts
    assert rejudged["O.cli"][0] in (0, 4)  # a pass, or INCONCLUSIVE: never a failure


@pytest.mark.engine
def test_the_output_and_the_report_say_the_scoring_came_from_other_hardware(rejudged):
    note = "scored on this machine's CPU (float32) for a golden recorded on NVIDIA H200"
    for cid in ("H", "O"):
        assert any(note in line and "scoring from other hardware" in line for line in rejudged["lines"][cid])
        assert any(line.startswith(f"{cid} vs J: signals: generate, scoring (cross-hardware: {note}")
                   for line in rejudged["lines"][cid]), rejudged["lines"][cid]
        summary = rejudged[f"{cid}.cli"][1]["cases"][0]["summary"]
        scoring = summary["signals"]["scoring"]
        assert scoring["cross_hardware"] is True and scoring["note"].startswith(note)
        assert scoring["golden_hardware"] == "NVIDIA H200" and scoring["dtype"] == "float32"
        assert summary["signals"]["scored"] is True and summary["signals"]["forced"] is False
