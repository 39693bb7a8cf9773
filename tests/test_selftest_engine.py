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
        comparison = comparemod.compare(smoke_suite, case.id, root=tmp_path, session=engine_pool, echo=lambda m: None)
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
    # forced replay ran only where needed: S1's sequences that kept J's tokens reuse their own rows,
    # E (a fault counting decode steps) was replayed in full
    golden = store.read_run(store.run_path(tmp_path, "smoke", "J"))
    for cid, mode in (("S1", "partial"), ("E", "full")):
        cand = store.read_run(store.run_path(tmp_path, "smoke", cid, role="candidate"))
        source = store.read_run(store.run_path(tmp_path, "smoke", cid, kind="forced", reference="J")).meta.source
        same = [i for i in range(len(golden.sequences))
                if list(cand.sequence(i).token_id[: golden.sequences[i].n_tokens]) == list(golden.sequence(i).token_id)]
        assert source["replay"] == mode, (cid, source)
        assert source["reused"] == ([] if mode == "full" else same), (cid, source)
    # E asked for a partial replay: its prefill at t* restarts the fault's decode-step clock, so the
    # replayed row at t* is not what E generated there; noticed, and those sequences replayed in full
    again = comparemod.compare(smoke_suite, "E", root=tmp_path, session=engine_pool, echo=lambda m: None,
                               replay="partial", force=True)
    assert again.verdict is Verdict.GIBBERISH
    source = store.read_run(store.run_path(tmp_path, "smoke", "E", kind="forced", reference="J")).meta.source
    assert source["replay"] == "partial" and source["replayed_full"], source
    assert {r["seq"] for r in source["replayed_full"]} <= set(source["replayed"]), source
    assert all(source["replay_from"][r["seq"]] == 0 and r["from_step"] >= 8 for r in source["replayed_full"])
    # the recorded runs can be re-judged offline, without an engine
    run_file = store.run_path(tmp_path, "smoke", "E", role="candidate")
    offline = comparemod.compare(smoke_suite, "E", root=tmp_path, run_file=run_file, echo=lambda m: None)
    assert offline.verdict is Verdict.GIBBERISH
