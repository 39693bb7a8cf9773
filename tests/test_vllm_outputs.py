"""vLLM's two logprob containers (dicts, FlatLogprobs) convert to the same dense columns.

The containers are built by vLLM's own code (``append_logprobs_for_next_position``, the
function its output processor calls per step) from synthetic sampler rows; the expected
columns come straight from those rows: the sampled token's logprob is column 0, the top-k
are columns 1..k in rank order.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from diffcheck.engines import vllm_outputs

K = 5
N = 7


def _rows(seed: int, sampled_in_topk: bool):
    rng = np.random.default_rng(seed)
    top_ids = np.stack([rng.choice(1000, K, replace=False) for _ in range(N)])
    top_lps = -np.sort(rng.gamma(2.0, 1.0, size=(N, K)), axis=1)
    if sampled_in_topk:  # the sampled token is one of the top-k (greedy: rank 1)
        sampled, ranks = top_ids[:, 0].copy(), np.ones(N, np.int64)
        sampled_lps = top_lps[:, 0].copy()
    else:
        sampled, ranks = rng.integers(1000, 2000, N), rng.integers(K + 1, 50, N)
        sampled_lps = top_lps[:, -1] - rng.gamma(1.0, 1.0, N)
    ids = np.concatenate([sampled[:, None], top_ids], axis=1)
    lps = np.concatenate([sampled_lps[:, None], top_lps], axis=1).astype(np.float32)
    return ids, lps, ranks


def _container(flat: bool, ids, lps, ranks, num_logprobs=K):
    from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position

    out = FlatLogprobs() if flat else []
    for t in range(len(ids)):
        append_logprobs_for_next_position(out, ids[t].tolist(), lps[t].tolist(), itertools.repeat(None),
                                          int(ranks[t]), num_logprobs)
    return out


@pytest.mark.parametrize("sampled_in_topk", [True, False])
@pytest.mark.parametrize("flat", [False, True])
def test_both_containers_give_the_sampler_rows(flat, sampled_in_topk):
    ids, lps, ranks = _rows(1, sampled_in_topk)
    dense = vllm_outputs.steps_from_logprobs(ids[:, 0].tolist(), _container(flat, ids, lps, ranks), K)
    np.testing.assert_array_equal(dense["token_id"], ids[:, 0])
    np.testing.assert_array_equal(dense["logprob"], lps[:, 0])
    np.testing.assert_array_equal(dense["topk_ids"], ids[:, 1:])
    np.testing.assert_array_equal(dense["topk_logprobs"], lps[:, 1:])
    assert dense["topk_ids"].dtype == np.int32 and dense["logprob"].dtype == np.float32


def test_the_flat_layout_is_converted_without_the_per_step_path():
    ids, lps, ranks = _rows(2, False)
    assert vllm_outputs._from_flat(ids[:, 0].tolist(), _container(True, ids, lps, ranks), K) is not None


def test_a_flat_slice_as_scoring_takes_it_converts_like_the_dicts():
    ids, lps, ranks = _rows(3, True)
    flat, dicts = _container(True, ids, lps, ranks)[2:], _container(False, ids, lps, ranks)[2:]
    a = vllm_outputs.steps_from_logprobs(ids[2:, 0].tolist(), flat, K)
    b = vllm_outputs.steps_from_logprobs(ids[2:, 0].tolist(), dicts, K)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    np.testing.assert_array_equal(a["topk_ids"], ids[2:, 1:])


def test_an_unexpected_flat_layout_falls_back_to_the_general_path():
    """Fewer than k + 1 entries per step (a vLLM that asked for fewer): no fast path, same answer."""
    ids, lps, ranks = _rows(4, False)
    flat = _container(True, ids, lps, ranks, num_logprobs=K - 2)
    assert vllm_outputs._from_flat(ids[:, 0].tolist(), flat, K) is None
    dense = vllm_outputs.steps_from_logprobs(ids[:, 0].tolist(), flat, K)
    np.testing.assert_array_equal(dense["topk_ids"][:, : K - 2], ids[:, 1: K - 1])
    assert (dense["topk_ids"][:, K - 2:] == -1).all()
    np.testing.assert_array_equal(dense["logprob"], lps[:, 0])


def test_a_run_is_judged_as_it_is_stored(tmp_path):
    """An engine's run, judged live against its own stored copy, is IDENTICAL (every step exactly
    the stored one). Judging the engine's float32 against a stored golden read the codec's
    rounding as an engine difference: a clean re-run was INCONCLUSIVE live and IDENTICAL when
    re-judged from its file."""
    import dataclasses

    from factories import make_run

    from diffcheck.core.types import Verdict
    from diffcheck.judging import classify
    from diffcheck.storage import store

    parts = []
    for seed in (5, 6):
        ids, lps, ranks = _rows(seed, True)
        lps = lps * np.float32(1.0 + 1e-3 * seed)  # values the codec's 6 bits do not hold exactly
        parts.append(vllm_outputs.steps_from_logprobs(ids[:, 0].tolist(), _container(False, ids, lps, ranks), K))
    steps = vllm_outputs.concat(parts, K)
    shell = make_run(tokens=[p["token_id"].tolist() for p in parts], k=K)
    live = dataclasses.replace(shell, steps=steps)
    store.write_run(tmp_path / "J.parquet", live)
    stored = store.read_run(tmp_path / "J.parquet")
    for column in ("logprob", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(stored.steps, column), getattr(live.steps, column))
    assert store.content_digest(stored) == store.content_digest(live)
    assert classify.compare_runs(stored, live).verdict is Verdict.IDENTICAL
