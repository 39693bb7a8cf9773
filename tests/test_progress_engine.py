"""Progress from the real engine: reported while it works, and the outputs exactly as without it.

With ``progress=`` the engine drives vLLM's step loop itself (``LLM.enqueue`` and
``llm_engine.step``, what ``LLM.generate`` does inside) to count tokens as they come;
the runs must be identical, bit for bit, to runs through ``LLM.generate``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.engine


def same_run(a, b) -> None:
    assert [s.n_tokens for s in a.sequences] == [s.n_tokens for s in b.sequences]
    assert [s.text for s in a.sequences] == [s.text for s in b.sequences]
    for name in ("token_id", "logprob", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(a.steps, name), getattr(b.steps, name), err_msg=name)


def recorder():
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total=None: calls.append((done, total))


def test_generate_force_and_score_report_progress_and_return_the_same_runs(engine, reference_run):
    max_tokens = int(engine.case.sampling.max_tokens)
    n = len(engine.prompts)
    plain = engine.generate()  # after reference_run: both warm
    calls, progress = recorder()
    tracked = engine.generate(progress=progress)
    same_run(tracked, plain)
    assert calls[0] == (0, n * max_tokens)
    assert len(calls) > max_tokens // 2  # one report per engine step, not one at the end
    done = [d for d, _ in calls]
    assert done == sorted(done) and done[-1] == tracked.n_tokens == calls[-1][1]

    calls, progress = recorder()
    same_run(engine.force(reference_run, progress=progress), engine.force(reference_run))
    assert calls[-1] == (reference_run.n_tokens, reference_run.n_tokens) and len(calls) > 2

    calls, progress = recorder()
    same_run(engine.score(reference_run, progress=progress), engine.score(reference_run))
    prefill = sum(len(s.prompt_token_ids) + s.n_tokens for s in reference_run.sequences)
    assert calls[0] == (0, prefill) and calls[-1] == (prefill, prefill)
