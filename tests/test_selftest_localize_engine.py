"""`diffcheck localize` and `selftest --localize` on the real engine.

A tiny suite (2 prompts, 10 tokens) with a lost head in layer 5 from decode step 3, run again by the
workflow in layer 17, a benign batch variant and a compiled case. The rows say localize named layer
5's and layer 17's attention at step 4 (decode step 3 produces output token 4, from the fault spec),
nothing for the batch variant, and the compiled case is skipped with its reason; the reference and
its floor were captured once for all rows. `diffcheck localize` of M5 afterwards finds every capture
stored and starts no engine; its answer says the fault is in that attention, not inherited, and
that what follows it inherits it. Four engine starts: J (golden and capture), J's restart replica,
M5 (M5.layer17's fault is switched into M5's engine: one eager configuration), S1."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import ROOT
from factories import write_suite

pytestmark = pytest.mark.engine

TOKENS = 10
STEP, AROUND = 4, 4  # `selftest --localize`'s step for the fault (decode step 3 -> output token 4), steps 0..4
FAULT = {"DIFFCHECK_FAULT": "lost-head", "DIFFCHECK_FAULT_STEP": "3", "DIFFCHECK_FAULT_LAYER": "5"}
PASS = {"not_verdict": ["DEGRADED", "GIBBERISH"]}
CASES = {
    "J": {"role": "reference", "description": "eager fp32 reference"},
    "M5": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "lost head in layer 5",
           "env": FAULT, "expect": {"verdict": "DEGRADED"}},
    "S1": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "one sequence at a time",
           "engine": {"max_num_seqs": 1}, "expect": PASS},
    "O": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "compiled",
          "engine": {"enforce_eager": False}, "expect": PASS},
}


@pytest.fixture(scope="module")
def selftested(tmp_path_factory):
    from diffcheck import cases, workspace
    from diffcheck.engines import session as sessionmod
    from diffcheck.workflows import calibrate, localize
    from diffcheck.workflows import selftest_localize as stl

    folder = tmp_path_factory.mktemp("stloc")
    suite = cases.load_suite(write_suite(
        folder, CASES, name="stloc", description="selftest --localize engine test",
        prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
        sampling={"max_tokens": TOKENS, "temperature": 0.7, "top_p": 0.95, "top_k": 20, "seed": 1234, "logprobs": 5},
        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_gib": 1}))
    root = folder / "goldens"
    restart = tuple(p for p in calibrate.PERTURBATIONS if p.name == "restart")  # 2 prompts: batch3/5 = J's shape
    lines: list[str] = []
    with sessionmod.EngineSession(taps=True, switch_faults=True) as session:
        golden = sessionmod.generate(suite.cases["J"], session=session, echo=lambda _: None)
        workspace.store_golden(root, suite.cases["J"], golden)
        report = stl.run(suite, root=root, layers=(17,), perturbations=restart, session=session, echo=lines.append)
        still_open = set(session.engines)
        captures: dict = {}
        m5 = localize.localize(suite.cases["M5"], suite=suite, root=root, step=STEP, around=AROUND,
                               perturbations=restart, session=session, captures=captures, echo=lines.append)
        opened = set(session.engines) - still_open
    for r in report.rows:  # what the run measured (pytest -s; docs/localize.md)
        print(r.case_id, r.expected, "->", r.named, r.ok, r.note, {k: round(v, 1) for k, v in r.captured.items()})
    first = m5.localization.first
    print("M5", first and (first.step, first.site, first.ratio, first.inherited), m5.timings)
    return SimpleNamespace(report=report, still_open=still_open, lines=lines, suite=suite, m5=m5, captures=captures,
                           opened=opened)


def test_the_layer_variant_switches_its_fault_into_the_engine_of_its_case(selftested):
    """M5.layer17 differs from M5 only in its fault's layer: it gets M5's engine with its own fault switched
    in (and its row above names layer 17, not M5's layer 5); S1, a clean case, gets an engine of its own."""
    lines = selftested.lines
    starts = [line for line in lines if line.startswith("starting engine ")]
    assert [line.split()[2] for line in starts] == ["J.floor-restart", "M5", "S1"], starts  # J: the golden's
    assert "faults switched in at runtime" in starts[1] and "switched" not in starts[2]
    assert sum("M5.layer17: switching the kept engine to fault lost-head" in line for line in lines) == 1, lines


def test_the_rows_name_the_faulty_layers_and_nothing_for_the_benign_variant(selftested):
    report = selftested.report
    rows = {r.case_id: r for r in report.rows}
    assert list(rows) == ["M5", "M5.layer17", "S1", "O"]
    assert (rows["M5"].expected, rows["M5"].named, rows["M5"].ok) == ("step 4, layers.5.self_attn",) * 2 + (True,)
    assert (rows["M5.layer17"].expected, rows["M5.layer17"].named) == ("step 4, layers.17.self_attn",) * 2
    assert rows["M5.layer17"].ok and rows["M5.layer17"].variant_of == "M5"
    assert (rows["S1"].expected, rows["S1"].named, rows["S1"].ok, rows["S1"].step) == ("nothing", "nothing", True, 4)
    assert rows["O"].ok is None and "torch.compile" in rows["O"].note
    assert not report.failed and len(report.passed) == 3
    assert all(r.steps == (0, 1, 2, 3, 4) for r in report.rows if r.ok is not None)


def test_the_reference_and_its_floor_are_captured_once_and_candidates_closed(selftested):
    report, still_open, lines = selftested.report, selftested.still_open, selftested.lines
    captured = [cid for r in report.rows for cid in r.captured]
    assert sorted(captured) == sorted(["J", "J.floor-restart", "M5", "M5.layer17", "S1"])  # each once
    assert still_open == {"J", "J.floor-restart"}  # every candidate's engine closed after its row
    assert any(line.startswith("[1/3] M5") for line in lines) and any(line.startswith("[3/3] S1") for line in lines)


def test_localize_names_the_fault_as_in_its_op_from_stored_captures(selftested):
    from diffcheck.cases.faults import parse_env

    m5 = selftested.m5
    assert selftested.opened == set(), "localize started an engine for captures already stored"
    assert set(m5.timings.values()) == {0.0}  # every capture came from the store
    spec = parse_env(selftested.suite.cases["M5"].env)
    first = m5.localization.first
    assert first is not None and (first.step, first.layer, first.op) == (spec.step + 1, spec.layer, "self_attn")
    assert not first.inherited and first.ratio > 10
    assert all(e <= m for _, e, m in first.inputs)  # its input was inside its floor


def test_what_follows_the_faulty_attention_inherits_it(selftested):
    from diffcheck.judging import localize as L

    by_case = {key[0]: cap for key, cap in selftested.captures.items()}
    loc = L.localize(by_case["J"], by_case["M5"], selftested.m5.localization.floors, n_worst=10_000)
    layer = selftested.m5.localization.first.layer
    others = {(f.layer, f.op): f for f in loc.worst}
    assert others[(layer, "post_attention_layernorm")].inherited
    assert others[(layer, "mlp")].inherited
    assert others[(layer + 1, "self_attn")].inherited
    assert all(f.inherited for f in loc.worst)  # nothing else is blamed
    assert all(f.layer is not None and f.layer >= layer for f in loc.worst)  # nothing before the faulty layer moved
