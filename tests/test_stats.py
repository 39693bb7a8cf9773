"""The top-K KL estimator (kl_estimator), per-step stats, summaries and reductions (stats),
the change detectors (changepoint).

The KL estimator is checked against oracles written here in plain float64 code from
synthetic FULL-vocabulary distributions, never against the module's own formula or
constants: the true KL, and the KL of the two distributions merged onto the buckets
the estimator uses (each listed id its own bucket, every other id in one).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from diffcheck.judging import changepoint as C
from diffcheck.judging import kl_estimator as KL
from diffcheck.judging import stats as S

from factories import make_run

V, K = 300, 20
# The estimator reads float32 logprobs and computes in float32 (about 1e-7 relative error
# per logprob, a few 1e-7 nats on a row's KL); the oracles are float64.
F32_RTOL, F32_ATOL = 1e-4, 1e-5


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def topk(logprobs: np.ndarray, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logprobs, axis=-1, kind="stable")[..., :k]
    return order.astype(np.int32), np.take_along_axis(logprobs, order, -1).astype(np.float32)


def true_kl(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """KL(reference || candidate) over the whole vocabulary; rows of float64 log-probabilities."""
    return (np.exp(r) * (r - c)).sum(-1)


def coarse_kl(r: np.ndarray, c: np.ndarray, ids_r: np.ndarray, ids_c: np.ndarray) -> np.ndarray:
    """Per row: KL between the full distributions merged onto the ids of both lists (one bucket
    each; -1 is padding) and one bucket for all other ids."""
    out = []
    for lr, lc, a, b in zip(r, c, ids_r, ids_c):
        listed = sorted({int(i) for i in a if i >= 0} | {int(i) for i in b if i >= 0})
        rest = np.setdiff1d(np.arange(lr.shape[0]), listed)
        p, q = np.exp(lr), np.exp(lc)
        buckets = [(p[i], q[i]) for i in listed] + [(p[rest].sum(), q[rest].sum())]
        out.append(sum(pb * math.log(pb / qb) for pb, qb in buckets if pb > 0))
    return np.array(out)


def noisy_pairs(scale: float, sigma: float, *, n: int = 5000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Full rows: reference logits N(0, scale^2) per id; candidate logits = reference + N(0, sigma^2)."""
    rng = np.random.default_rng(seed)
    ref = log_softmax(rng.standard_normal((n, V)) * scale)
    return ref, log_softmax(ref + sigma * rng.standard_normal(ref.shape))


def same_id_sets(ids_r: np.ndarray, ids_c: np.ndarray) -> np.ndarray:
    return (np.sort(ids_r, 1) == np.sort(ids_c, 1)).all(1)


@pytest.fixture()
def rows():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((400, V)) * 3
    return rng, log_softmax(logits)


def test_kl_is_zero_for_identical_distributions(rows):
    _, lp = rows
    ids, lps = topk(lp)
    assert np.all(KL.topk_kl(ids, lps, ids, lps) == 0.0)  # bit-identical chunk: short cut
    moved = lps.copy()
    moved[::2] -= 0.01  # other rows of the chunk differ: the formula itself must give 0
    kl = KL.topk_kl(ids, lps, ids, moved)
    assert np.all(kl[1::2] == 0.0) and np.all(kl[::2] > 0)


def test_kl_of_identical_distributions_in_another_order_is_zero_up_to_rounding(rows):
    rng, lp = rows
    ids, lps = topk(lp)
    perm = rng.permuted(np.tile(np.arange(K), (len(ids), 1)), axis=1)
    kl = KL.topk_kl(ids, lps, np.take_along_axis(ids, perm, 1), np.take_along_axis(lps, perm, 1))
    assert np.abs(kl).max() < 1e-5


def test_kl_is_nonnegative_and_grows_with_distance(rows):
    rng, lp = rows
    noise = rng.standard_normal(lp.shape)
    ids_r, lr = topk(lp)
    means = []
    for scale in (0.01, 0.1, 0.5, 1.0, 2.0):
        ids_c, lc = topk(log_softmax(lp + scale * noise))
        kl = KL.topk_kl(ids_r, lr, ids_c, lc)
        assert np.all(kl >= 0)
        means.append(float(kl.mean()))
    assert means == sorted(means) and means[0] < means[-1] / 100


# --- bias against the true KL (the numbers are the module docstring's) -----------------------------


@pytest.mark.parametrize("scale, sigma", [(5.0, 0.05), (5.0, 0.3), (3.0, 0.1)])
def test_same_id_lists_give_the_merged_kl_a_lower_bound_of_the_true_kl(scale, sigma):
    ref, cand = noisy_pairs(scale, sigma, n=2000)
    ids_r, lr = topk(ref)
    ids_c, lc = topk(cand)
    same = same_id_sets(ids_r, ids_c)
    assert same.sum() > 100  # enough rows with equal sets to say something
    est = KL.topk_kl(ids_r[same], lr[same], ids_c[same], lc[same]).astype(np.float64)
    merged = coarse_kl(ref[same], cand[same], ids_r[same], ids_c[same])
    exact = true_kl(ref[same], cand[same])
    np.testing.assert_allclose(est, merged, rtol=F32_RTOL, atol=F32_ATOL)
    assert np.all(merged <= exact + 1e-12)  # the log-sum inequality: merging ids never raises KL
    assert np.all(est <= exact + F32_ATOL)  # "a lower bound, up to float32 rounding: at most 1e-5 above"


# (reference logit scale, noise sigma) -> (mean estimate / mean true KL, correlation above,
# most any row exceeds its true KL, in nats): the table in diffcheck/judging/kl_estimator.py's docstring.
# Each bound held on 40 samples like this one (seeds 0-39, 200,000 rows in all); 1e-5 is float32
# rounding, i.e. "never above".
MEASURED = {
    (5.0, 0.3): ((0.97, 0.98), 0.99, 1e-3),
    (5.0, 1.0): ((0.96, 0.98), 0.99, 0.25),
    (3.0, 0.4): ((0.83, 0.85), 0.98, 1e-5),
    (1.0, 0.5): ((0.27, 0.29), 0.75, 1e-5),
}


@pytest.mark.parametrize("scale, sigma", list(MEASURED), ids=[f"scale{a}-sigma{b}" for a, b in MEASURED])
def test_measured_bias_on_synthetic_distributions(scale, sigma):
    (low, high), min_corr, max_over = MEASURED[scale, sigma]
    ref, cand = noisy_pairs(scale, sigma)
    est = KL.topk_kl(*topk(ref), *topk(cand)).astype(np.float64)
    exact = true_kl(ref, cand)
    assert low <= est.mean() / exact.mean() <= high
    assert np.corrcoef(est, exact)[0, 1] > min_corr
    assert (est - exact).max() <= max_over


def test_differing_lists_can_land_far_on_either_side_of_the_true_kl():
    """Imputation guesses the probability of an id missing from one side's list; a wrong guess
    moves the estimate either way, and without bound."""
    # Over: the candidate's 2% tail is spread thin, but id 20 (missing from its top-20, on the
    # reference's) is imputed at min(p_K, tail / 1) = the whole tail, leaving the candidate's
    # "other" at the floor while the reference keeps 27% there.
    q = np.full(V, 0.02 / (V - 20))
    q[:20] = 0.049
    p = np.zeros(V)
    p[:19], p[20] = 0.035, 0.03
    rest = np.setdiff1d(np.arange(V), [*range(19), 20])
    p[rest] = (1 - p.sum()) / rest.size
    over_r, over_c = np.log(p), np.log(q)
    # Under: the reference's id 19 is all but impossible for the candidate (1e-9), which lists
    # id 20 instead; imputed at the candidate's smallest listed probability, it looks harmless.
    q2 = np.full(V, 0.1 / (V - 21))
    q2[:19], q2[20], q2[19] = 0.9 / 20, 0.9 / 20, 1e-9
    p2 = np.full(V, 0.1 / (V - 20))
    p2[:20] = 0.9 / 20
    under_r, under_c = np.log(p2 / p2.sum()), np.log(q2 / q2.sum())
    ref, cand = np.stack([over_r, under_r]), np.stack([over_c, under_c])
    est = KL.topk_kl(*topk(ref), *topk(cand)).astype(np.float64)
    exact = true_kl(ref, cand)
    assert est[0] > 3 * exact[0] and est[0] - exact[0] > 2  # 3.2 nats estimated, 0.78 true
    assert est[1] < exact[1] / 4


# --- the estimator's arithmetic, exactly -------------------------------------------------------


def tied_pair(rng, *, k_r: int, k_c: int, shared: int, held: bool) -> tuple[np.ndarray, ...]:
    """Full reference and candidate rows (float64 log-probabilities) and their listed ids: k_r and
    k_c ids, `shared` of them on both lists, built so that the documented imputation of an id
    listed on one side only, min(p_K, tail / m) on the other side, is its true probability there:

    - held=False: each such id has exactly that side's smallest listed probability p_K (a tie at
      the K-th place) and the unlisted ids hold more, so min() picks p_K;
    - held=True: the m such ids share the side's tail equally, each below p_K, and the unlisted
      ids hold next to nothing, so min() picks tail / m and "other" is empty.

    The estimate must then equal the merged KL of the full rows (`coarse_kl`)."""
    ids = rng.permutation(V)
    both, only_r, only_c = ids[:shared], ids[shared:k_r], ids[k_r:k_r + k_c - shared]
    rest = ids[k_r + k_c - shared:]

    def side(listed, others):
        w = np.zeros(V)
        w[listed] = rng.uniform(1.0, 4.0, listed.size)
        smallest = w[listed].min()
        if held:
            w[others] = smallest * rng.uniform(0.2, 0.9)
            w[rest] = smallest * 1e-12
        else:
            w[others] = smallest
            w[rest] = rng.uniform(0.0, smallest, rest.size) * rng.uniform(0.05, 1.0)
        return np.log(w / w.sum())

    list_r, list_c = np.concatenate([both, only_r]), np.concatenate([both, only_c])
    return side(list_r, only_c), side(list_c, only_r), list_r, list_c


def as_topk(row: np.ndarray, listed: np.ndarray, order: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """One side's top-K list of `listed` ids: by descending probability or shuffled; padded to K
    with -1 / -inf."""
    listed = listed[np.argsort(-row[listed], kind="stable")] if order == "sorted" else rng.permutation(listed)
    ids = np.full(K, -1, np.int32)
    lps = np.full(K, -np.inf, np.float32)
    ids[:listed.size], lps[:listed.size] = listed, row[listed]
    return ids, lps


# (k_r, k_c, shared, order of the lists): every path of the estimator
LAYOUTS = [
    (20, 20, 20, "same order"),  # equal lists: the fast path
    (20, 20, 20, "sorted"),  # the same ids, each side in its own order
    (20, 20, 14, "sorted"),  # partial overlap
    (20, 20, 0, "sorted"),  # disjoint lists
    (15, 20, 15, "sorted"),  # reference padded
    (20, 12, 10, "sorted"),  # candidate padded
    (17, 13, 9, "shuffled"),  # both padded, unsorted
    (20, 20, 16, "shuffled"),  # unsorted
]


@pytest.mark.parametrize("held", [False, True], ids=["imputed-at-p_K", "imputed-at-tail-share"])
def test_estimate_equals_the_merged_kl_when_imputation_is_exact(held):
    rng = np.random.default_rng(11)
    r_rows, c_rows, ids_r, lr, ids_c, lc = [], [], [], [], [], []
    for k_r, k_c, shared, order in LAYOUTS * 25:
        r, c, list_r, list_c = tied_pair(rng, k_r=k_r, k_c=k_c, shared=shared, held=held)
        r_ids, r_lps = as_topk(r, list_r, "sorted" if order == "same order" else order, rng)
        if order == "same order":  # the candidate lists the same ids in the reference's order
            c_ids, c_lps = r_ids.copy(), c[r_ids].astype(np.float32)
        else:
            c_ids, c_lps = as_topk(c, list_c, order, rng)
        r_rows.append(r), c_rows.append(c)
        ids_r.append(r_ids), lr.append(r_lps), ids_c.append(c_ids), lc.append(c_lps)
    ids_r, lr, ids_c, lc = map(np.stack, (ids_r, lr, ids_c, lc))
    est = KL.topk_kl(ids_r, lr, ids_c, lc)
    merged = coarse_kl(np.stack(r_rows), np.stack(c_rows), ids_r, ids_c)
    np.testing.assert_allclose(est, merged, rtol=F32_RTOL, atol=F32_ATOL)
    assert merged.min() > 0.01  # real differences, not a comparison of zeros


def test_missing_ids_are_handled_symmetrically():
    """A reference id missing from the candidate and a candidate id missing from the reference
    are imputed by the same rule on the other side."""
    lp_r = np.log(np.array([[0.5, 0.3, 0.1]], np.float32))
    lp_c = np.log(np.array([[0.5, 0.1, 0.3]], np.float32))
    ids_a, ids_b = np.array([[1, 2, 3]], np.int32), np.array([[1, 2, 4]], np.int32)
    # By hand: both tails are 0.1 and one id is missing on each side, so each is imputed at
    # min(p_K, tail / 1) = 0.1 and "other" is left empty on both sides. Over the buckets
    # {1, 2, 3, 4}: reference (.5, .3, .1, .1), candidate (.5, .1, .1, .3):
    # KL = .3 ln(.3/.1) + .1 ln(.1/.3) = 0.2 ln 3.
    forward = KL.topk_kl(ids_a, lp_r, ids_b, lp_c)[0]
    assert forward == pytest.approx(0.2 * math.log(3), rel=1e-5)
    # swapping which side lacks which id: same structure, mirrored numbers
    mirrored = KL.topk_kl(ids_b, lp_r, ids_a, lp_c)[0]
    assert mirrored == pytest.approx(forward, rel=1e-5)


def test_topk_kl_cuts_to_the_smaller_k(rows):
    _, lp = rows
    ids, lps = topk(lp)
    ids5, lps5 = topk(lp, 5)
    assert np.all(KL.topk_kl(ids, lps, ids5, lps5) == KL.topk_kl(ids5, lps5, ids5, lps5))


def steps_of(ids, lps, tokens):
    """One sequence's steps: these top-K lists, and each token's logprob from its list (-20 if absent)."""
    token_lp = [lps[i, list(ids[i]).index(t)] if t in ids[i] else -20.0 for i, t in enumerate(tokens)]
    return make_run([tokens], logprobs=[token_lp], topk_ids=[ids], topk_logprobs=[lps]).steps


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
    np.testing.assert_array_equal(st.kl, KL.topk_kl(ids_r, lr, ids_c, lc))


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
    assert C.cusum(healthy, baseline=1.5, drift=3.0, threshold=15.0) is None
    shifted = healthy.copy()
    shifted[60:] = rng.normal(11.0, 1.5, 40)
    cp = C.cusum(shifted, baseline=1.5, drift=3.0, threshold=15.0)
    assert cp is not None and 59 <= cp.onset <= 61 and cp.onset <= cp.alarm <= 63


def test_cusum_step_cap_stops_a_single_outlier_from_alarming():
    x = np.full(30, 1.5)
    x[10] = 40.0  # one absurd token
    assert C.cusum(x, baseline=1.5, drift=3.0, threshold=15.0) is not None
    assert C.cusum(x, baseline=1.5, drift=3.0, threshold=15.0, step_cap=5.0) is None
    x[10:15] = 40.0  # five in a row do
    assert C.cusum(x, baseline=1.5, drift=3.0, threshold=15.0, step_cap=5.0).onset == 10


def test_cusum_onset_is_the_last_reset_before_the_alarm():
    x = np.array([0, 0, 10, 0, 0, 10, 10, 10], float)
    cp = C.cusum(x, baseline=0, drift=1, threshold=20)
    # S: 0 0 9 8 7 16 25 -> the run that alarms started at step 2 (S never returned to 0)
    assert (cp.onset, cp.alarm) == (2, 6)


def test_persistent_onset():
    flags = np.zeros(40, bool)
    flags[5] = True  # isolated
    flags[20:40] = True
    flags[25] = False  # a gap inside a persistent run
    assert C.persistent_onset(flags, window=8, fraction=0.75) == 20
    last = np.zeros(40, bool)
    last[-2:] = True  # two flags at the very end: the window is cut below half
    assert C.persistent_onset(last, window=8, fraction=0.75) is None
    assert C.persistent_onset(np.zeros(0, bool), window=8, fraction=0.75) is None
