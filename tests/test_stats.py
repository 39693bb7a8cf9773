"""stats: the top-K KL estimator, per-step stats, summaries, reductions, detectors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffcheck.judging import stats as S
from diffcheck.types import Steps

V, K = 300, 20


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def topk(logprobs: np.ndarray, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logprobs, axis=-1, kind="stable")[..., :k]
    return order.astype(np.int32), np.take_along_axis(logprobs, order, -1).astype(np.float32)


def naive_kl(ids_r, lr, ids_c, lc) -> float:
    """The documented estimator, written out with dicts, one row at a time."""
    ref = {int(i): math.exp(float(v)) for i, v in zip(ids_r, lr) if i >= 0}
    cand = {int(i): math.exp(float(v)) for i, v in zip(ids_c, lc) if i >= 0}
    floor = float(S.TAIL_FLOOR)
    tail_r, tail_c = max(1 - sum(ref.values()), floor), max(1 - sum(cand.values()), floor)
    only_r = [i for i in ref if i not in cand]
    only_c = [i for i in cand if i not in ref]
    q_imp = max(min(min(cand.values()), tail_c / max(len(only_r), 1)), float(S.PROB_FLOOR))
    p_imp = max(min(min(ref.values()), tail_r / max(len(only_c), 1)), float(S.PROB_FLOOR))
    p, q = dict(ref), dict(cand)
    p.update({i: p_imp for i in only_c})
    q.update({i: q_imp for i in only_r})
    p["other"] = max(tail_r - len(only_c) * p_imp, floor)
    q["other"] = max(tail_c - len(only_r) * q_imp, floor)
    return max(sum(pv * (math.log(pv) - math.log(q[i])) for i, pv in p.items() if pv > 0), 0.0)


def true_kl(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (np.exp(r) * (r - c)).sum(-1)


@pytest.fixture()
def rows():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((400, V)) * 3
    return rng, log_softmax(logits)


def test_kl_is_zero_for_identical_distributions(rows):
    _, lp = rows
    ids, lps = topk(lp)
    assert np.all(S.topk_kl(ids, lps, ids, lps) == 0.0)  # bit-identical chunk: short cut
    moved = lps.copy()
    moved[::2] -= 0.01  # other rows of the chunk differ: the formula itself must give 0
    kl = S.topk_kl(ids, lps, ids, moved)
    assert np.all(kl[1::2] == 0.0) and np.all(kl[::2] > 0)


def test_kl_of_identical_distributions_in_another_order_is_zero_up_to_rounding(rows):
    rng, lp = rows
    ids, lps = topk(lp)
    perm = rng.permuted(np.tile(np.arange(K), (len(ids), 1)), axis=1)
    kl = S.topk_kl(ids, lps, np.take_along_axis(ids, perm, 1), np.take_along_axis(lps, perm, 1))
    assert np.abs(kl).max() < 1e-5


def test_kl_is_nonnegative_and_grows_with_distance(rows):
    rng, lp = rows
    noise = rng.standard_normal(lp.shape)
    ids_r, lr = topk(lp)
    means = []
    for scale in (0.01, 0.1, 0.5, 1.0, 2.0):
        ids_c, lc = topk(log_softmax(lp + scale * noise))
        kl = S.topk_kl(ids_r, lr, ids_c, lc)
        assert np.all(kl >= 0)
        means.append(float(kl.mean()))
    assert means == sorted(means) and means[0] < means[-1] / 100


def test_kl_is_a_lower_bound_of_the_true_kl_when_tails_are_small():
    rng = np.random.default_rng(3)
    lp = log_softmax(rng.standard_normal((300, V)) * 5)  # peaked: top-20 tails ~5%
    cand = log_softmax(lp + 0.3 * rng.standard_normal(lp.shape))
    est = S.topk_kl(*topk(lp), *topk(cand))
    exact = true_kl(lp, cand)
    assert est.mean() <= exact.mean() * 1.05
    assert est.mean() >= exact.mean() * 0.5
    assert np.corrcoef(est, exact)[0, 1] > 0.9


def test_vectorized_estimator_matches_the_written_out_one(rows):
    """Both the fast path (equal id lists) and the sort-matching path, with padding,
    one-sided ids on either side and permutations."""
    rng, lp = rows
    ids_r, lr = topk(lp)
    ids_c, lc = topk(log_softmax(lp + 0.4 * rng.standard_normal(lp.shape)))
    ids_c[:50], lc[:50] = ids_r[:50], lr[:50] + 0.01  # equal lists: fast path
    ids_r[60:80, 15:], lr[60:80, 15:] = -1, -np.inf  # reference padded
    ids_c[70:90, 12:], lc[70:90, 12:] = -1, -np.inf  # candidate padded
    ids_c[90:100], lc[90:100] = ids_c[90:100, ::-1], lc[90:100, ::-1]  # unsorted candidate lists
    ids_c[100:110] = ids_c[100:110] + 1000  # disjoint supports
    kl = S.topk_kl(ids_r, lr, ids_c, lc)
    expected = np.array([naive_kl(*row) for row in zip(ids_r, lr, ids_c, lc)])
    np.testing.assert_allclose(kl, expected, rtol=2e-3, atol=2e-5)


def test_missing_ids_are_handled_symmetrically():
    """A reference id missing from the candidate and a candidate id missing from the
    reference are imputed by the same rule on the other side."""
    lp_r = np.log(np.array([[0.5, 0.3, 0.1]], np.float32))
    lp_c = np.log(np.array([[0.5, 0.1, 0.3]], np.float32))
    ids_a, ids_b = np.array([[1, 2, 3]], np.int32), np.array([[1, 2, 4]], np.int32)
    forward = S.topk_kl(ids_a, lp_r, ids_b, lp_c)[0]
    assert forward == pytest.approx(naive_kl(ids_a[0], lp_r[0], ids_b[0], lp_c[0]), rel=1e-5)
    # swapping which side lacks which id: same structure, mirrored numbers
    mirrored = S.topk_kl(ids_b, lp_r, ids_a, lp_c)[0]
    assert mirrored == pytest.approx(forward, rel=1e-5)
    assert forward > 0


def test_topk_kl_cuts_to_the_smaller_k(rows):
    _, lp = rows
    ids, lps = topk(lp)
    ids5, lps5 = topk(lp, 5)
    assert np.all(S.topk_kl(ids, lps, ids5, lps5) == S.topk_kl(ids5, lps5, ids5, lps5))


def steps_of(ids, lps, tokens) -> Steps:
    n = len(tokens)
    token_lp = np.array([lps[i, list(ids[i]).index(t)] if t in ids[i] else -20.0 for i, t in enumerate(tokens)])
    return Steps(seq=np.zeros(n, np.int32), step=np.arange(n, dtype=np.int32), token_id=np.asarray(tokens, np.int32),
                 logprob=token_lp.astype(np.float32), topk_ids=ids, topk_logprobs=lps)


def test_compare_steps_per_step_quantities(rows):
    rng, lp = rows
    ids_r, lr = topk(lp[:30])
    ids_c, lc = topk(log_softmax(lp[:30] + 0.5 * rng.standard_normal((30, V))))
    tokens = ids_r[:, 0]
    ref, cand = steps_of(ids_r, lr, tokens), steps_of(ids_c, lc, tokens)
    st = S.compare_steps(ref, cand, workers=1)
    np.testing.assert_allclose(st.dlogprob, cand.logprob - ref.logprob)
    np.testing.assert_allclose(st.dp, np.exp(cand.logprob) - np.exp(ref.logprob), rtol=1e-6)
    assert st.top1.tolist() == (ids_r[:, 0] == ids_c[:, 0]).tolist()
    overlap = [len(set(a) & set(b)) / K for a, b in zip(ids_r, ids_c)]
    np.testing.assert_allclose(st.overlap, overlap)
    np.testing.assert_array_equal(st.kl, S.topk_kl(ids_r, lr, ids_c, lc))


def test_row_lists_keep_mask_and_threads_agree(rows, monkeypatch):
    rng, lp = rows
    ids_r, lr = topk(lp)
    ids_c, lc = topk(log_softmax(lp + 0.2 * rng.standard_normal(lp.shape)))
    tokens = ids_r[:, 0]
    ref, cand = steps_of(ids_r, lr, tokens), steps_of(ids_c, lc, tokens)
    monkeypatch.setattr(S, "CHUNK_ROWS", 64)  # several chunks, so the thread pool runs
    keep = rng.random(len(tokens)) < 0.7
    rows_kept = np.flatnonzero(keep)
    by_rows = S.compare_steps(ref, cand, reference_rows=rows_kept, candidate_rows=rows_kept, workers=1)
    by_keep = S.compare_steps(ref, cand, keep=keep, workers=3)
    for name in ("dlogprob", "dp", "top1", "overlap"):
        np.testing.assert_array_equal(getattr(by_rows, name), getattr(by_keep, name))
    # row sums run through BLAS, whose rounding depends on how rows are batched
    np.testing.assert_allclose(by_rows.kl, by_keep.kl, rtol=1e-4, atol=1e-7)
    assert len(by_keep) == keep.sum()


def test_summarize_matches_llama_cpp_definitions():
    st = S.StepStats(
        dlogprob=np.array([0.0, -0.1, 0.2, 0.0], np.float32),
        dp=np.array([0.0, -0.1, 0.2, 0.1], np.float32),
        kl=np.array([0.0, 0.1, 0.2, 0.3], np.float32),
        top1=np.array([True, True, False, True]),
        overlap=np.array([1.0, 1.0, 0.5, 1.0], np.float32),
    )
    s = S.summarize(st)
    assert s["n"] == 4
    assert s["kl_mean"] == pytest.approx(0.15)
    assert s["kl_mean_se"] == pytest.approx(np.std([0, 0.1, 0.2, 0.3], ddof=1) / 2)
    assert s["kl_max"] == pytest.approx(0.3) and s["kl_p50"] == pytest.approx(0.15)
    assert s["kl_p99"] == pytest.approx(np.percentile([0, 0.1, 0.2, 0.3], 99))
    assert s["same_top1"] == pytest.approx(0.75)
    assert s["dp_rms"] == pytest.approx(math.sqrt((0.01 + 0.04 + 0.01) / 4), rel=1e-6)
    assert s["dp_min"] == pytest.approx(-0.1) and s["dp_max"] == pytest.approx(0.2)
    assert s["dlogprob_abs_max"] == pytest.approx(0.2)
    assert S.summarize(S.StepStats.empty())["kl_mean"] is None


def test_segment_reductions_match_python():
    rng = np.random.default_rng(1)
    counts = np.array([3, 0, 5, 1, 0, 4])
    off = np.concatenate([[0], np.cumsum(counts)])
    x = rng.standard_normal(off[-1]).astype(np.float32)
    flags = x > 0.5
    parts = [x[a:b] for a, b in zip(off[:-1], off[1:])]
    np.testing.assert_allclose(S.segment_sum(x, off), [p.sum() for p in parts], rtol=1e-6)
    np.testing.assert_allclose(S.segment_max(x, off, empty=-9), [p.max() if p.size else -9 for p in parts])
    firsts = [int(np.argmax(p > 0.5)) if (p > 0.5).any() else -1 for p in parts]
    assert S.segment_first(flags, off).tolist() == firsts


def test_cusum_finds_a_mean_shift_and_ignores_single_spikes():
    rng = np.random.default_rng(0)
    healthy = np.abs(rng.normal(1.5, 1.0, 100))
    healthy[[20, 50]] = 9.0  # two surprising tokens, far apart
    assert S.cusum(healthy, baseline=1.5, drift=3.0, threshold=15.0) is None
    shifted = healthy.copy()
    shifted[60:] = rng.normal(11.0, 1.5, 40)
    cp = S.cusum(shifted, baseline=1.5, drift=3.0, threshold=15.0)
    assert cp is not None and 59 <= cp.onset <= 61 and cp.onset <= cp.alarm <= 63


def test_cusum_step_cap_stops_a_single_outlier_from_alarming():
    x = np.full(30, 1.5)
    x[10] = 40.0  # one absurd token
    assert S.cusum(x, baseline=1.5, drift=3.0, threshold=15.0) is not None
    assert S.cusum(x, baseline=1.5, drift=3.0, threshold=15.0, step_cap=5.0) is None
    x[10:15] = 40.0  # five in a row do
    assert S.cusum(x, baseline=1.5, drift=3.0, threshold=15.0, step_cap=5.0).onset == 10


def test_cusum_onset_is_the_last_reset_before_the_alarm():
    x = np.array([0, 0, 10, 0, 0, 10, 10, 10], float)
    cp = S.cusum(x, baseline=0, drift=1, threshold=20)
    # S: 0 0 9 8 7 16 25 -> the run that alarms started at step 2 (S never returned to 0)
    assert (cp.onset, cp.alarm) == (2, 6)


def test_persistent_onset():
    flags = np.zeros(40, bool)
    flags[5] = True  # isolated
    flags[20:40] = True
    flags[25] = False  # a gap inside a persistent run
    assert S.persistent_onset(flags, window=8, fraction=0.75) == 20
    last = np.zeros(40, bool)
    last[-2:] = True  # two flags at the very end: the window is cut below half
    assert S.persistent_onset(last, window=8, fraction=0.75) is None
    assert S.persistent_onset(np.zeros(0, bool), window=8, fraction=0.75) is None
