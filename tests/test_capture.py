"""Top-k logprobs captured on the device (`diffcheck.engines.capture`).

The real-engine test holds the device capture to vLLM's own logprobs path, run in the same
engine: the oracle is vLLM's output, not diffcheck's code. The rule tests hold the matching
of engine rows to outputs to hand-written answers.
"""

from __future__ import annotations

import numpy as np
import pytest

from diffcheck.core.errors import EngineError
from diffcheck.engines.base import ForceJob
from diffcheck.engines.capture import steps_for
from diffcheck.engines.taps import prompt_key

K = 2


def _req(prompt, tokens, *, base=0.0):
    n = len(tokens)
    return {"prompt": prompt_key(prompt), "tokens": list(tokens),
            "logprob": [base - i for i in range(n)],
            "topk_ids": [[t, t + 1] for t in tokens],
            "topk_logprobs": [[base - i, base - i - 0.5] for i in range(n)]}


def _answer(*reqs):
    """The worker's answer: rows grouped by request, each field one buffer of raw int32/float32 bytes."""
    def raw(key, dtype):
        return np.asarray([v for r in reqs for v in r[key]], dtype).tobytes()

    return {"k": K, "unsampled": 0, "prompts": [r["prompt"] for r in reqs], "counts": [len(r["tokens"]) for r in reqs],
            "tokens": raw("tokens", np.int32), "logprob": raw("logprob", np.float32),
            "topk_ids": raw("topk_ids", np.int32), "topk_logprobs": raw("topk_logprobs", np.float32)}


def test_rows_of_a_chunked_prefill_and_an_extra_step_after_a_stop_are_left_out():
    prompt = [5, 6, 7]
    # two discarded prefill-chunk samples (9, 9), the output (1, 2, 3), one step scheduled after the stop (4)
    got = steps_for(_answer(_req(prompt, [9, 9, 1, 2, 3, 4])), [prompt], [[1, 2, 3]], K, case_id="c")
    assert got[0]["token_id"].tolist() == [1, 2, 3]
    assert got[0]["logprob"].tolist() == [-2.0, -3.0, -4.0]
    assert got[0]["topk_ids"].tolist() == [[1, 2], [2, 3], [3, 4]]
    assert got[0]["topk_logprobs"].shape == (3, K)


def test_outputs_of_one_prompt_take_the_requests_whose_tokens_they_are():
    prompt = [1, 2]
    answer = _answer(_req(prompt, [7, 8], base=-10.0), _req(prompt, [3, 4], base=-20.0), _req([9], [3, 4]))
    got = steps_for(answer, [prompt, prompt, [9]], [[3, 4], [7, 8], [3, 4]], K, case_id="c")
    assert got[0]["logprob"].tolist() == [-20.0, -21.0]
    assert got[1]["logprob"].tolist() == [-10.0, -11.0]
    assert got[2]["logprob"].tolist() == [0.0, -1.0]


def test_an_output_without_rows_is_an_engine_error():
    with pytest.raises(EngineError, match="no rows for output 1"):
        steps_for(_answer(_req([1], [2, 3])), [[1], [1]], [[2, 3], [2, 3]], K, case_id="c")
    with pytest.raises(EngineError, match="not armed for top-2"):
        steps_for(None, [[1]], [[2]], K, case_id="c")


def test_an_empty_output_gets_empty_arrays():
    got = steps_for(_answer(_req([1], [4])), [[1]], [[]], K, case_id="c")
    assert got[0]["topk_ids"].shape == (0, K)


def test_a_request_shorter_than_the_output_does_not_answer_it():
    with pytest.raises(EngineError, match="no rows for output 0"):
        steps_for(_answer(_req([1], [2, 3])), [[1]], [[2, 3, 4, 5]], K, case_id="c")


def test_the_device_capture_gives_vllms_own_logprobs_bit_for_bit(engine):
    """Same engine, same requests: generated and forced once with the device capture, once through
    vLLM's logprobs path; every array, token and text the same."""
    assert engine.capture == "device", engine.info().get("logprob_capture")
    assert engine.info()["logprob_capture"] == "device"
    runs, forced = {}, {}
    try:
        for where in ("device", "vllm"):
            engine.capture = where
            runs[where] = engine.generate()
            gold = runs["device"]
            jobs = [ForceJob(index=i, start=0, context=list(s.prompt_token_ids),
                             forced=[int(t) for t in gold.sequence(i).token_id][:10])
                    for i, s in enumerate(gold.sequences)]
            forced[where] = engine._force_rows(jobs, 20)
    finally:
        engine.capture = "device"
    a, b = runs["device"].steps, runs["vllm"].steps
    assert len(a.token_id) > 0
    for field in ("seq", "step", "token_id", "logprob", "topk_ids", "topk_logprobs"):
        assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=True), field
    assert [s.text for s in runs["device"].sequences] == [s.text for s in runs["vllm"].sequences]
    for x, y in zip(forced["device"], forced["vllm"]):
        assert x.tokens == y.tokens
        for key in ("token_id", "logprob", "topk_ids", "topk_logprobs"):
            assert np.array_equal(x.steps[key], y.steps[key], equal_nan=True), key


def test_chunked_reduction_gives_the_per_step_numbers_across_flushes_and_a_failed_step():
    """The buffered logits are reduced in chunks (a budget of 3 rows here, so batches of 2 flush every
    other step, and a batch of 5 outgrows the buffer): each row's numbers equal log_softmax, topk and
    gather run on that step alone; a step whose sampler raised (its rows given back) leaves no row."""
    import torch

    from diffcheck.engines.capture import _Chunks

    gen = torch.Generator().manual_seed(7)
    vocab, k = 50, 4
    chunks = _Chunks(k, budget=3 * vocab * 4)
    expected = []
    for step, n in enumerate([2, 2, 1, 5, 2, 3]):
        logits = torch.randn(n, vocab, generator=gen)
        chunks.keep(logits)
        if step == 4:
            chunks.drop(n)  # the sampler raised
            continue
        tokens = torch.randint(0, vocab, (n, 1), generator=gen)
        chunks.sampled([f"r{step}.{i}" for i in range(n)], tokens)
        lp = logits.log_softmax(-1, dtype=torch.float32)
        values, ids = torch.topk(lp, k, dim=-1)
        expected.append((tokens, lp.gather(-1, tokens), values, ids))
        logits.fill_(0.0)  # the sampler may change its logits in place after the copy
    chunks.flush()
    got = [torch.cat([d[i] for d in chunks.done]) for i in range(4)]
    for i in range(4):
        assert torch.equal(got[i], torch.cat([e[i] for e in expected]))
    assert len(chunks.done) > 2 and len(chunks.req_rows) == got[0].shape[0] == 13
