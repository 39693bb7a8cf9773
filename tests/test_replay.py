"""Forced replay only where needed (diffcheck.engines.replay): plans, assembled runs, modes.

The oracle is a synthetic deterministic model: the distribution at each step is a
function of the context (prompt + tokens so far) alone, the way an engine's
distribution is. A full forced run is that model evaluated along the golden's
tokens; the assembled partial run must equal it exactly, built from the
candidate's generate rows and the rows replayed from t*.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from diffcheck.core.errors import ConfigError
from diffcheck.engines import replay
from factories import make_run, write_suite

V, K = 64, 6
PROMPT = (11, 12, 13)


def model_rows(tokens) -> np.ndarray:
    """log-probabilities [len(tokens), V]: row t depends on PROMPT + tokens[:t] only."""
    rows = []
    for t in range(len(tokens)):
        context = np.asarray(PROMPT + tuple(int(x) for x in tokens[:t]), np.int64)
        rng = np.random.default_rng(zlib.crc32(context.tobytes()))
        logits = rng.normal(0.0, 3.0, V)
        rows.append(logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max())
    return np.asarray(rows, np.float64).reshape(len(tokens), V)


def generate_run(paths, **kw):
    return make_run([np.asarray(p, np.int64) for p in paths], distributions=[model_rows(p) for p in paths], k=K,
                    prompt_token_ids=PROMPT, **kw)


def forced_rows_run(paths, starts):
    """What an engine returns for `starts`: sequence i holds the model's rows along paths[i] from starts[i]."""
    parts = [list(p)[s:] if s is not None else [] for p, s in zip(paths, starts)]
    rows = [model_rows(p)[s:] if s is not None else np.zeros((0, V)) for p, s in zip(paths, starts)]
    return make_run([np.asarray(p, np.int64) for p in parts], distributions=rows, k=K, prompt_token_ids=PROMPT,
                    kind="forced", role="candidate",
                    case_id="O", source={"reference": "J", "mechanism": "test", "from_steps": list(starts)},
                    timings={"force_s": 1.5, "force_tokens": sum(len(p) for p in parts)})


rng = np.random.default_rng(7)
G = [rng.integers(0, V, n).tolist() for n in (12, 12, 8, 10, 0, 9)]
C = [
    G[0],                                   # identical: reused
    G[1][:5] + [(G[1][5] + 1) % V] + G[1][6:],  # diverges at 5
    G[2] + [3, 4, 5],                       # the golden is a prefix of the candidate: reused
    G[3][:4],                               # stops early: the candidate is a prefix of the golden, replay from 4
    [1, 2, 3],                              # empty golden sequence: nothing to force
    [(G[5][0] + 1) % V] + G[5][1:],         # diverges at step 0
]


def test_plan_reuses_what_the_candidate_walked_and_replays_from_t_star():
    golden, candidate = generate_run(G), generate_run(C, role="candidate", case_id="O")
    todo = replay.plan(golden, candidate, "partial")
    assert todo.starts == (None, 5, None, 4, None, 0)
    assert todo.replayed == (1, 3, 5) and todo.reused == (0, 2, 4)
    assert todo.replay_steps == (12 - 5) + (10 - 4) + 9
    assert todo.total_steps == sum(len(g) for g in G)
    assert "3 of 6 sequences replayed" in todo.describe()
    full = replay.plan(golden, candidate, "full")
    assert full.starts == (0, 0, 0, 0, None, 0) and full.replay_steps == full.total_steps


def test_plan_replays_from_zero_when_prompts_differ():
    golden = generate_run(G[:1])
    other = make_run([G[0]], distributions=[model_rows(G[0])], k=K, prompt_token_ids=(9, 9))
    assert replay.plan(golden, other, "partial").starts == (0,)


def test_assembled_partial_replay_equals_the_full_forced_run():
    golden, candidate = generate_run(G), generate_run(C, role="candidate", case_id="O")
    todo = replay.plan(golden, candidate, "partial")
    part = forced_rows_run(G, todo.starts)
    got = replay.assemble(golden, candidate, todo, part, reference_id="J", mechanism="test")
    want = forced_rows_run(G, [0 if g else None for g in G])  # the oracle: every row along the golden
    for column in ("seq", "step", "token_id", "logprob", "topk_ids", "topk_logprobs"):
        assert np.array_equal(getattr(got.steps, column), getattr(want.steps, column)), column
    assert [s.n_tokens for s in got.sequences] == [len(g) for g in G]
    assert [s.prompt_id for s in got.sequences] == [s.prompt_id for s in golden.sequences]
    assert got.meta.kind == "forced"
    src = got.meta.source
    assert src["replay"] == "partial" and src["replayed"] == [1, 3, 5] and src["reused"] == [0, 2, 4]
    assert src["replay_from"] == [None, 5, None, 4, None, 0] and "from_steps" not in src
    assert src["reference"] == "J" and got.meta.timings["force_s"] == 1.5


def test_assembled_full_replay_is_the_engine_run():
    golden, candidate = generate_run(G), generate_run(C, role="candidate", case_id="O")
    todo = replay.plan(golden, candidate, "full")
    part = forced_rows_run(G, todo.starts)
    got = replay.assemble(golden, candidate, todo, part, reference_id="J", mechanism="test")
    assert np.array_equal(got.steps.logprob, part.steps.logprob)
    assert got.sequences == part.sequences
    assert got.meta.source["replay"] == "full" and got.meta.source["reused"] == [4]


def test_nothing_to_replay_needs_no_engine_run():
    golden = generate_run(G[:3])
    candidate = generate_run([G[0], G[1], G[2] + [1]], role="candidate", case_id="O",
                             timings={"generate_s": 2.0, "startup_s": 9.0})
    todo = replay.plan(golden, candidate, "partial")
    assert todo.replayed == ()
    got = replay.assemble(golden, candidate, todo, None, reference_id="J", mechanism="test")
    want = forced_rows_run(G[:3], [0, 0, 0])
    assert np.array_equal(got.steps.topk_logprobs, want.steps.topk_logprobs)
    assert got.meta.kind == "forced" and got.meta.timings["force_s"] == 0.0
    assert got.meta.timings["generate_s"] == 2.0 and got.meta.source["reused"] == [0, 1, 2]


def test_assemble_refuses_rows_that_leave_the_golden():
    golden, candidate = generate_run(G), generate_run(C, role="candidate", case_id="O")
    todo = replay.plan(golden, candidate, "partial")
    wrong = [list(g) for g in G]
    wrong[1][7] = (wrong[1][7] + 1) % V
    with pytest.raises(ValueError, match="seq 1"):
        replay.assemble(golden, candidate, todo, forced_rows_run(wrong, todo.starts), reference_id="J",
                        mechanism="test")
    with pytest.raises(ValueError, match="expected"):
        replay.assemble(golden, candidate, todo, forced_rows_run(G, [None, 4, None, 4, None, 0]),
                        reference_id="J", mechanism="test")


def test_mode_for_case_tag_step_faults_and_requests(tmp_path):
    from diffcheck import cases

    path = write_suite(tmp_path, {
        "J": {"role": "reference", "description": "ref"},
        "O": {"inherits": "J", "role": "candidate", "references": ["J"], "description": "plain"},
        "T": {"inherits": "O", "description": "tagged", "tags": ["replay-full"]},
        "E": {"inherits": "O", "description": "step fault",
              "env": {"DIFFCHECK_FAULT": "stale-decode-metadata", "DIFFCHECK_FAULT_STEP": "8"}},
        "H": {"inherits": "O", "description": "capture fault", "env": {"DIFFCHECK_FAULT": "seq-lens-copy"}},
    })
    suite = cases.load_suite(path)
    mode = {cid: replay.mode_for(suite.cases[cid]) for cid in ("O", "T", "E", "H")}
    assert mode["O"] == ("partial", "default")
    assert mode["T"] == ("full", "case tag replay-full")
    assert mode["E"][0] == "full" and "decode steps" in mode["E"][1]
    assert mode["H"] == ("partial", "default")  # acts from capture on: no decode-step clock
    assert replay.mode_for(suite.cases["E"], "partial") == ("partial", "requested")
    assert replay.mode_for(suite.cases["O"], "full") == ("full", "requested")
    with pytest.raises(ConfigError, match="valid: partial, full"):
        replay.mode_for(suite.cases["O"], "half")


def test_a_stored_full_replay_serves_a_partial_request_not_the_other_way():
    golden = generate_run(G[:2])
    full = forced_rows_run(G[:2], [0, 0])  # a forced run from before partial replay: no "replay" key
    assert replay.forced_meta_mode(full) == "full"
    assert replay.serves(full, "partial") and replay.serves(full, "full")
    candidate = generate_run([G[0], G[1][:3] + [0] * 9], role="candidate", case_id="O")
    todo = replay.plan(golden, candidate, "partial")
    part = replay.assemble(golden, candidate, todo, forced_rows_run(G[:2], todo.starts), reference_id="J",
                           mechanism="test")
    assert replay.serves(part, "partial") and not replay.serves(part, "full")


# -- a bug that depends on the decode history: a partial replay must notice it does not reproduce it --

CLOCK = 3  # the history-dependent model below goes wrong from its 3rd decode step after a prefill


def clocked_rows(tokens, start: int) -> np.ndarray:
    """An engine whose decode steps count from the last prefill (at `start`): rows from that clock's
    step CLOCK on are another distribution. The rows along `tokens` from `start`."""
    rows = model_rows(tokens)[start:]
    for j in range(CLOCK, len(rows)):
        rows[j] = np.roll(rows[j], 7)  # a different, still normalized distribution
    return rows


def clocked_run(paths, starts, **kw):
    parts = [list(p)[s:] if s is not None else [] for p, s in zip(paths, starts)]
    rows = [clocked_rows(p, s) if s is not None else np.zeros((0, V)) for p, s in zip(paths, starts)]
    return make_run([np.asarray(p, np.int64) for p in parts], distributions=rows, k=K, prompt_token_ids=PROMPT, **kw)


def test_a_partial_replay_that_does_not_reproduce_the_generation_is_redone_from_step_0():
    golden = generate_run(G)
    candidate = clocked_run(C, [0] * len(C), role="candidate", case_id="O")  # generated from step 0
    todo = replay.plan(golden, candidate, "partial")
    assert todo.starts == (None, 5, None, 4, None, 0)
    part = clocked_run(G, todo.starts, kind="forced", role="candidate", case_id="O",
                       source={"reference": "J", "mechanism": "test"}, timings={"force_s": 1.0, "force_tokens": 22})
    # seq 1: generated at t*=5 on decode clock 5 (wrong rows), replayed at 5 on clock 0 (right rows): noticed.
    # seq 3 stopped at 4 (no generate row at t*), seq 5 replays from step 0 like its generation: not redone.
    redo = replay.unreproduced(candidate, todo, part)
    assert list(redo) == [1] and redo[1] > replay.REPRODUCE_KL
    full = clocked_run(G, [None, 0, None, None, None, None], kind="forced", role="candidate", case_id="O",
                       source={"reference": "J", "mechanism": "test"}, timings={"force_s": 2.0, "force_tokens": 12})
    todo2, part2 = replay.with_full(todo, part, full, redo)
    assert todo2.starts == (None, 0, None, 4, None, 0)
    got = replay.assemble(golden, candidate, todo2, part2, reference_id="J", mechanism="test")
    # the oracle: seq 1 is the engine's rows along the golden from step 0, the others as the partial replay had them
    assert np.array_equal(got.sequence(1).topk_logprobs, full.sequence(1).topk_logprobs)
    assert np.array_equal(got.sequence(3).topk_logprobs[4:], part.sequence(3).topk_logprobs)
    assert np.array_equal(got.sequence(5).topk_logprobs, part.sequence(5).topk_logprobs)
    assert got.meta.source["replayed_full"] == [{"seq": 1, "from_step": 5, "kl": round(redo[1], 6)}]
    assert got.meta.timings["force_s"] == 3.0 and got.meta.timings["force_tokens"] == 34
    # an engine without the history dependence: its partial replay reproduces the generation, nothing is redone
    clean_part = forced_rows_run(G, todo.starts)
    assert replay.unreproduced(generate_run(C, role="candidate", case_id="O"), todo, clean_part) == {}
    assert replay.unreproduced(candidate, replay.plan(golden, candidate, "full"), part) == {}
