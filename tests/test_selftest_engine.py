"""A short selftest with the real engine: the smoke suite's fault is caught, its benign variant passes."""

from __future__ import annotations

import pytest

from diffcheck.workflows import compare as comparemod
from diffcheck.workflows import record, selftest
from diffcheck.storage import store
from diffcheck.core.types import Verdict

pytestmark = pytest.mark.engine


def test_short_selftest(tmp_path, smoke_suite, engine_pool):
    record.record_golden(smoke_suite.cases["J"], root=tmp_path, session=engine_pool, echo=lambda m: None)
    outcomes = []
    for case in selftest.labelled_cases(smoke_suite):
        # E counts decode steps: asked for a partial replay, whose prefill at t* restarts that count
        comparison = comparemod.compare(smoke_suite, case.id, root=tmp_path, session=engine_pool, echo=lambda m: None,
                                        replay="partial")
        outcomes += [selftest.outcome(case, v) for v in comparison.verdicts]
    by_case = {o.case_id: o for o in outcomes}
    assert set(by_case) == {"S1", "E"}
    fault = by_case["E"]
    assert fault.verdict is Verdict.GIBBERISH, fault
    assert fault.onset_error is not None and fault.onset_error <= 8, fault
    assert by_case["S1"].verdict is not Verdict.GIBBERISH, by_case["S1"]
    assert all(o.passed for o in outcomes), outcomes
    table = selftest.confusion(outcomes)
    assert table["diffcheck"] == {"gibberish fault": "1/1", "degraded fault": "0/0", "precision variant": "0/0",
                                  "benign": "0/1"}
    # forced replay ran only where needed: the sequences that kept J's tokens reuse their own rows
    golden = store.read_run(store.run_path(tmp_path, "smoke", "J"))
    sources = {}
    for cid in ("S1", "E"):
        cand = store.read_run(store.run_path(tmp_path, "smoke", cid, role="candidate"))
        source = sources[cid] = store.read_run(store.run_path(tmp_path, "smoke", cid, kind="forced",
                                                              reference="J")).meta.source
        same = [i for i in range(len(golden.sequences))
                if list(cand.sequence(i).token_id[: golden.sequences[i].n_tokens]) == list(golden.sequence(i).token_id)]
        assert source["replay"] == "partial" and source["reused"] == same, (cid, source)
    # E's replayed row at t* (a prefill: the fault's clock restarted) is not what E generated there (a decode
    # step with the stale metadata): noticed, and those sequences replayed from step 0, so E is still GIBBERISH
    source = sources["E"]
    assert source["replayed_full"] and {r["seq"] for r in source["replayed_full"]} <= set(source["replayed"]), source
    assert all(source["replay_from"][r["seq"]] == 0 and r["from_step"] >= 8 for r in source["replayed_full"])
    assert "replayed_full" not in sources["S1"], sources["S1"]
    # the recorded runs can be re-judged offline, without an engine
    run_file = store.run_path(tmp_path, "smoke", "E", role="candidate")
    offline = comparemod.compare(smoke_suite, "E", root=tmp_path, run_file=run_file, echo=lambda m: None)
    assert offline.verdict is Verdict.GIBBERISH
