"""Per-step comparison of two next-token distributions seen in the same context.

Longer than 400 lines because the KL estimator's derivation and its measured bias are documented beside the vectorized code.

Knows the step columns of runs (`types.Steps`) and numpy; nothing about verdicts,
tolerances, engines or text. Callers pick the row pairs that share a context
(reference vs candidate before t*, reference vs forced at every step) and get per-step
curves (`StepStats`), llama.cpp-style summaries (`summarize`), per-sequence reductions
(`segment_*`) and the two change detectors the classifier uses on per-step curves
(`cusum`, `persistent_onset`).

Per-step quantities, for a row pair (reference r, candidate c) with the same context
and the same token (the reference's):

- ``dlogprob`` = logprob_c(token) - logprob_r(token) (nats).
- ``dp`` = p_c(token) - p_r(token): llama.cpp's Δp of the "correct" token.
- ``top1``: the two argmax ids agree.  ``overlap``: |top-k_r ∩ top-k_c| / K.
- ``kl``: KL(reference || candidate) estimated from the two top-K lists, as follows.

The top-K KL estimator. Only the top-K ids and logprobs of each side are stored, so
the full-vocabulary KL cannot be computed. We build a common partition of the
vocabulary: each id in the union U of the two top-K lists is its own bucket, and all
other ids form one "other" bucket. Each side's mass on each bucket:

- an id in its own top-K: its stored probability;
- an id only in the other side's top-K: imputed as ``min(p_K, tail / m)``, where p_K is
  this side's K-th (smallest stored) probability, tail = 1 - sum(stored probabilities),
  and m the number of such missing ids. The id cannot be more probable than p_K (it is
  not in the top-K) and the missing ids cannot hold more than the tail together;
- "other": what is left of the tail after the imputations.

Both sides are then proper distributions over the same |U| + 1 buckets, and the
estimate is the exact KL between them. Identical distributions give exactly 0; results
are clipped at 0 against rounding. Tails are floored at `TAIL_FLOOR`: float32 sums of
K probabilities carry ~1e-7 error, so tails below ~1e-6 are noise, not signal.

How the estimate relates to the true (full-vocabulary) KL:

- Both sides hold the same ids (the common case): nothing is imputed, and the estimate
  is the KL of the two distributions merged onto the buckets, which by the log-sum
  inequality is at most the true KL. It is a lower bound, up to float32 rounding and
  the tail floor (never more than 1e-5 nats above in the measured rows).
- The lists differ: an imputed probability can be too high or too low, so the
  estimate can land on either side of the true KL, and there is no bound in general.
  When m * p_K >= tail the imputation hands a side's whole tail to its m missing ids
  and leaves its "other" at the floor; against a heavy "other" on the reference side
  that overshoots (tests/test_stats.py builds a row estimated at 3.2 nats whose true
  KL is 0.78). An id the other side all but rules out, imputed at its p_K, undershoots.

Measured on synthetic full-vocabulary distributions (tests/test_stats.py: V = 300,
K = 20, reference logits N(0, s^2) per id, candidate logits = reference + N(0, σ^2);
every range held on each of 40 samples of 5000 rows; "never" allows float32 rounding):

    top-20 tail  s  σ    mean estimate / mean true KL  correlation  any row above the true KL
    ~1%          5  0.3  0.97-0.98                     > 0.99       by < 1e-3 nats
    ~1%          5  1.0  0.96-0.98                     > 0.99       by < 0.25 nats (worst: 0.59, true 0.39)
    ~12%         3  0.4  0.83-0.85                     > 0.98       never
    ~70%         1  0.5  0.27-0.29                     > 0.75       never

With heavy tails the estimate sees only a small part of the true KL. Compare estimates
with each other (same K, same model), not with full-vocabulary KL from other tools.

Speed: float32 throughout, processed in row chunks that stay in cache, on a few
threads (numpy releases the GIL). Every chunk first takes the fast path as if the id
lists were equal (no matching, no imputation); rows whose lists differ are then
recomputed by the general path, which matches ids with one per-row sort of int32 keys.
Row sums use einsum: axis-1 sums are slow for short rows, and BLAS (matmul) runs its
own threads, which stall for milliseconds per call on a loaded 2-core machine.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from diffcheck.core.types import Steps

TAIL_FLOOR = np.float32(1e-6)
PROB_FLOOR = np.float32(1e-30)  # imputed probabilities below float32 resolution
CHUNK_ROWS = 16384  # 16k x K=20 float32 = 1.3 MB per array: stays in L2
WORKERS = min(4, os.cpu_count() or 1)  # threads for the chunk loop of compare_steps
NLL_CAP = 50.0  # an -inf logprob counts as 50 nats: decisive, but keeps sums finite

KL_PERCENTILES = (("max", 100.0), ("p99_9", 99.9), ("p99", 99.0), ("p95", 95.0), ("p90", 90.0), ("p50", 50.0))
DP_PERCENTILES = (
    ("max", 100.0), ("p99_9", 99.9), ("p99", 99.0), ("p95", 95.0), ("p90", 90.0), ("p75", 75.0),
    ("p50", 50.0), ("p25", 25.0), ("p10", 10.0), ("p5", 5.0), ("p1", 1.0), ("p0_1", 0.1), ("min", 0.0),
)


@dataclass(frozen=True)
class StepStats:
    """Per-step comparison curves over a list of same-context row pairs (arrays [n])."""

    dlogprob: np.ndarray  # float32: candidate - reference logprob of the reference token
    dp: np.ndarray  # float32: p_candidate - p_reference of the reference token
    kl: np.ndarray  # float32: top-K estimate of KL(reference || candidate), >= 0
    top1: np.ndarray  # bool: same argmax id
    overlap: np.ndarray  # float32: |top-K intersection| / K

    def __len__(self) -> int:
        return int(self.kl.shape[0])

    def slice(self, a: int, b: int) -> "StepStats":
        return StepStats(self.dlogprob[a:b], self.dp[a:b], self.kl[a:b], self.top1[a:b], self.overlap[a:b])

    @staticmethod
    def empty() -> "StepStats":
        f = np.zeros(0, np.float32)
        return StepStats(f, f, f, np.zeros(0, bool), f)


def _kl_same_ids(lr: np.ndarray, lc: np.ndarray) -> np.ndarray:
    """KL rows whose two id lists are equal: no matching, no imputation needed."""
    pr = np.exp(lr)
    d = lr - lc
    if lr[:, -1].min() == -np.inf:  # padded rows (fewer than K ids): -inf - -inf is nan
        d[lr == -np.inf] = 0.0
    sum_pr = _row_sum(pr)
    inner = np.einsum("ij,ij->i", pr, d)
    sum_pc = _row_sum(np.exp(lc, out=pr))  # reuses pr's buffer
    tail_r = np.maximum(np.float32(1.0) - sum_pr, TAIL_FLOOR)
    tail_c = np.maximum(np.float32(1.0) - sum_pc, TAIL_FLOOR)
    return np.maximum(inner + tail_r * (np.log(tail_r) - np.log(tail_c)), np.float32(0.0))


def _row_sum(x: np.ndarray) -> np.ndarray:
    """Sum of each row. numpy's axis-1 sum is slow for short rows and a matrix-vector
    product goes to BLAS, whose own threads stall badly on a loaded 2-core machine
    (milliseconds per call); einsum does neither."""
    return np.einsum("ij->i", x)


def _row_min(x: np.ndarray) -> np.ndarray:
    """Minimum of each row: column by column, which beats numpy's axis-1 reduction for
    short rows."""
    out = x[:, 0].copy()
    for j in range(1, x.shape[1]):
        np.minimum(out, x[:, j], out=out)
    return out


def _kl_general(ids_r, lr, ids_c, lc) -> tuple[np.ndarray, np.ndarray]:
    """KL and overlap count for rows with different id lists (see module docstring).

    Ids are matched by a per-row sort rather than a [n, K, K] compare: each entry gets
    the key (id << b) | position (reference positions 0..K-1, candidate K..2K-1); after
    sorting a row, an id on both lists is a reference entry directly followed by a
    candidate entry with the same id (ids within one list are distinct)."""
    n, k = ids_r.shape
    zero, one = np.float32(0.0), np.float32(1.0)
    padded = ids_r[:, -1].min() < 0 or ids_c[:, -1].min() < 0  # padding sits at the end of a list
    pr = np.exp(lr)
    if padded:
        count_r = (ids_r >= 0).sum(1).astype(np.float32)
        count_c = (ids_c >= 0).sum(1).astype(np.float32)
        lc0 = np.where(ids_c >= 0, lc, zero)  # padding: -inf -> 0 so products stay finite
        lr0 = np.where(ids_r >= 0, lr, zero)
        ids_c = np.where(ids_c >= 0, ids_c, -2)  # padding (-1 on both sides) must never pair
    else:
        count_r = count_c = np.float32(k)
        lc0, lr0 = lc, lr
    sum_pr = _row_sum(pr)
    tail_r = np.maximum(one - sum_pr, TAIL_FLOOR)
    tail_c = np.maximum(one - _row_sum(np.exp(lc)), TAIL_FLOOR)
    # each side's K-th (smallest stored) probability; the minimum rather than the last
    # column, so an unsorted list cannot break the bound (padding is -inf: skipped)
    kth_r = np.exp(_row_min(np.where(lr0 == lr, lr, np.inf) if padded else lr))
    kth_c = np.exp(_row_min(np.where(lc0 == lc, lc, np.inf) if padded else lc))

    shift = int(2 * k - 1).bit_length()  # position bits
    ids = np.concatenate([ids_r, ids_c], axis=1)
    # int32 keys sort fastest; int64 for vocabularies too large to shift in 31 bits
    ids = ids.astype(np.int64 if int(ids.max()) >= (1 << (31 - shift)) else np.int32, copy=False)
    key = np.sort((ids << shift) | np.arange(2 * k, dtype=ids.dtype), axis=1)
    sid = key >> shift
    tag = key & ((1 << shift) - 1)
    is_r = tag < k
    pair = (sid[:, :-1] == sid[:, 1:]) & is_r[:, :-1] & ~is_r[:, 1:]  # reference at j, candidate at j+1
    pairf = pair.astype(np.float32)
    # p_reference where a reference entry sits, candidate logprob where a candidate one
    # does; a flat take is much faster than take_along_axis
    flat = (tag + (np.arange(n, dtype=tag.dtype) * (2 * k))[:, None]).ravel()
    vals = np.take(np.concatenate([pr, lc0], axis=1).ravel(), flat).reshape(n, 2 * k)
    pair_pr = vals[:, :-1] * pairf
    n_pair = _row_sum(pairf)
    sum_pair_pr = _row_sum(pair_pr)
    sum_pair_pr_lc = np.einsum("ij,ij->i", pair_pr, vals[:, 1:])
    sum_pair_lc = np.einsum("ij,ij->i", pairf, vals[:, 1:])

    miss_c = count_r - n_pair  # reference ids missing from the candidate's list
    miss_r = count_c - n_pair  # candidate ids missing from the reference's list
    q_imp = np.maximum(np.minimum(kth_c, tail_c / np.maximum(miss_c, one)), PROB_FLOOR)
    p_imp = np.maximum(np.minimum(kth_r, tail_r / np.maximum(miss_r, one)), PROB_FLOOR)
    other_r = np.maximum(tail_r - miss_r * p_imp, TAIL_FLOOR)
    other_c = np.maximum(tail_c - miss_c * q_imp, TAIL_FLOOR)
    # reference ids: sum p_r (log p_r - log q), q stored (paired) or imputed (lone)
    term_r = np.einsum("ij,ij->i", pr, lr0) - sum_pair_pr_lc - np.log(q_imp) * (sum_pr - sum_pair_pr)
    # candidate-only ids: the reference's imputed p_imp against the candidate's stored q
    term_c = p_imp * (miss_r * np.log(p_imp) - (_row_sum(lc0) - sum_pair_lc))
    term_o = other_r * (np.log(other_r) - np.log(other_c))
    kl = np.maximum(term_r + term_c + term_o, zero).astype(np.float32)
    return kl, n_pair.astype(np.int64)


def _fast_chunk(ids_r, lr, ids_c, lc, need=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First pass over one chunk: KL and overlap as if every row's id lists were equal,
    and the rows (local indices) where they are not, which `_general_rows` must redo.
    `need` (bool, optional) marks the rows whose result is used: others are not listed."""
    n, k = ids_r.shape
    if ids_r[:, -1].min() >= 0:
        overlap = np.ones(n, np.float32)
    else:
        overlap = (ids_r >= 0).sum(1).astype(np.float32) / k
    if np.array_equal(lr, lc) and np.array_equal(ids_r, ids_c):
        # bit-identical distributions (a clean graph replaying eager, a rerun): KL is 0
        return np.zeros(n, np.float32), overlap, np.zeros(0, np.int64)
    with np.errstate(invalid="ignore"):  # padded rows: -inf - -inf, fixed up inside
        kl = _kl_same_ids(lr, lc)
    # rows whose id lists differ; compared as int64 pairs when the layout allows (half the work)
    if (k % 2 == 0 and ids_r.flags.c_contiguous and ids_c.flags.c_contiguous
            and ids_r.dtype == ids_c.dtype == np.int32):
        neq, width = ids_r.view(np.int64) != ids_c.view(np.int64), k // 2
    else:
        neq, width = ids_r != ids_c, k
    flat = np.flatnonzero(neq.ravel()) // width
    bad = flat[np.concatenate([[True], flat[1:] != flat[:-1]])] if flat.size else flat
    if need is not None and bad.size:
        bad = bad[need[bad]]
    return kl, overlap, bad


def _general_rows(ids_r, lr, ids_c, lc, rows_r, rows_c, kl, overlap, out_rows) -> None:
    """Second pass: the general estimator for the listed row pairs, in chunks, written
    into kl / overlap at `out_rows`. Batching all such rows of a comparison keeps the
    general path's fixed per-call cost (some 40 numpy calls) off every chunk."""
    k = ids_r.shape[1]
    for a in range(0, out_rows.shape[0], CHUNK_ROWS):
        sr, sc, so = rows_r[a:a + CHUNK_ROWS], rows_c[a:a + CHUNK_ROWS], out_rows[a:a + CHUNK_ROWS]
        kl[so], count = _kl_general(ids_r[sr], lr[sr], ids_c[sc], lc[sc])
        overlap[so] = count / k


def topk_kl(reference_ids, reference_logprobs, candidate_ids, candidate_logprobs) -> np.ndarray:
    """Top-K estimate of KL(reference || candidate) per row ([n, K] inputs -> [n])."""
    ids_r, lr, ids_c, lc = _common_k(reference_ids, reference_logprobs, candidate_ids, candidate_logprobs)
    n = ids_r.shape[0]
    kl, overlap, bad = np.empty(n, np.float32), np.empty(n, np.float32), []
    for a in range(0, n, CHUNK_ROWS):
        b = a + CHUNK_ROWS
        kl[a:b], overlap[a:b], rows = _fast_chunk(ids_r[a:b], lr[a:b], ids_c[a:b], lc[a:b])
        bad.append(rows + a)
    rows = np.concatenate(bad) if bad else np.zeros(0, np.int64)
    _general_rows(ids_r, lr, ids_c, lc, rows, rows, kl, overlap, rows)
    return kl


def _common_k(ids_r, lr, ids_c, lc):
    """Cut both sides to the smaller K (a side with more ids has no partner for them)."""
    ids_r, ids_c = np.asarray(ids_r, np.int32), np.asarray(ids_c, np.int32)
    lr, lc = np.asarray(lr, np.float32), np.asarray(lc, np.float32)
    k = min(ids_r.shape[1], ids_c.shape[1])
    return ids_r[:, :k], lr[:, :k], ids_c[:, :k], lc[:, :k]


def compare_steps(
    reference: Steps,
    candidate: Steps,
    *,
    reference_rows: np.ndarray | None = None,
    candidate_rows: np.ndarray | None = None,
    keep: np.ndarray | None = None,
    workers: int | None = None,
) -> StepStats:
    """Per-step stats for row pairs that share a context and a token.

    Pairs are (reference_rows[i], candidate_rows[i]); without row lists, row i of each
    table, and then `keep` (bool per row) may select the pairs to return. Selecting
    with `keep` gathers nothing, which is cheaper when most rows are kept. Chunks run
    on `workers` threads (numpy releases the GIL in its kernels); default `WORKERS`.
    """
    if (reference_rows is None) != (candidate_rows is None):
        raise ValueError("give both reference_rows and candidate_rows, or neither")
    if reference_rows is None:
        if len(reference) != len(candidate):
            raise ValueError("without row lists both step tables need the same length")
        n = len(reference)
    else:
        n = int(reference_rows.shape[0])
        if int(candidate_rows.shape[0]) != n or keep is not None:
            raise ValueError("row lists must have equal lengths and cannot be combined with keep")
    if keep is not None and keep.all():
        keep = None

    def pick(col, rows):
        return col if rows is None else col[rows]

    lp_r = pick(reference.logprob, reference_rows).astype(np.float32, copy=False)
    lp_c = pick(candidate.logprob, candidate_rows).astype(np.float32, copy=False)
    k = min(reference.k, candidate.k)
    kl = np.zeros(n, np.float32)
    overlap = np.zeros(n, np.float32)
    top1 = np.zeros(n, bool)
    if k > 0 and n > 0:
        ids_r_all, lr_all = reference.topk_ids[:, :k], reference.topk_logprobs[:, :k]
        ids_c_all, lc_all = candidate.topk_ids[:, :k], candidate.topk_logprobs[:, :k]
        top1 = pick(ids_r_all[:, 0], reference_rows) == pick(ids_c_all[:, 0], candidate_rows)

        def chunk(a: int) -> np.ndarray:
            b = min(a + CHUNK_ROWS, n)
            if reference_rows is None:
                sr = sc = slice(a, b)
            else:
                sr, sc = reference_rows[a:b], candidate_rows[a:b]
            need = None if keep is None else keep[a:b]
            kl[a:b], overlap[a:b], bad = _fast_chunk(ids_r_all[sr], lr_all[sr], ids_c_all[sc], lc_all[sc], need)
            return bad + a

        starts = range(0, n, CHUNK_ROWS)
        workers = WORKERS if workers is None else workers
        if workers > 1 and len(starts) > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                bad = list(pool.map(chunk, starts))
        else:
            bad = [chunk(a) for a in starts]
        rows = np.concatenate(bad)
        rows_r = rows if reference_rows is None else reference_rows[rows]
        rows_c = rows if candidate_rows is None else candidate_rows[rows]
        _general_rows(ids_r_all, lr_all, ids_c_all, lc_all, rows_r, rows_c, kl, overlap, rows)
    if keep is not None:
        lp_r, lp_c, kl, overlap, top1 = lp_r[keep], lp_c[keep], kl[keep], overlap[keep], top1[keep]
    return StepStats(dlogprob=lp_c - lp_r, dp=np.exp(lp_c) - np.exp(lp_r), kl=kl, top1=top1, overlap=overlap)


def _percentiles(x: np.ndarray, table) -> dict[str, float]:
    """numpy's default ("linear") percentiles; short arrays are sorted once instead,
    which is much cheaper than np.percentile's per-call overhead."""
    qs = np.array([q for _, q in table], np.float64)
    n = x.shape[0]
    if n > 65536:
        values = np.percentile(x, qs)
    else:
        ordered = np.sort(x).astype(np.float64)
        pos = qs / 100.0 * (n - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, n - 1)
        values = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return {name: float(v) for (name, _), v in zip(table, values)}


def summarize(stats: StepStats) -> dict:
    """llama.cpp-style summary: mean KL ± standard error, KL percentiles, same-top-1
    rate, RMS Δp ± error, Δp percentiles, plus |Δlogprob| and top-K overlap. Keys with
    no data (n == 0) are None."""
    n = len(stats)
    out: dict = {"n": n}
    if n == 0:
        keys = ["kl_mean", "kl_mean_se", "same_top1", "same_top1_se", "dp_rms", "dp_rms_se",
                "overlap_mean", "dlogprob_abs_mean", "dlogprob_abs_max"]
        keys += [f"kl_{name}" for name, _ in KL_PERCENTILES] + [f"dp_{name}" for name, _ in DP_PERCENTILES]
        return out | {k: None for k in keys}
    kl = stats.kl.astype(np.float64)
    out["kl_mean"] = float(kl.mean())
    out["kl_mean_se"] = float(kl.std(ddof=1) / np.sqrt(n)) if n > 1 else 0.0
    out |= {f"kl_{k}": v for k, v in _percentiles(stats.kl, KL_PERCENTILES).items()}
    top1 = float(stats.top1.mean())
    out["same_top1"] = top1
    out["same_top1_se"] = float(np.sqrt(top1 * (1.0 - top1) / n))
    dp2 = stats.dp.astype(np.float64) ** 2
    rms = float(np.sqrt(dp2.mean()))
    out["dp_rms"] = rms
    # error propagation from the mean of dp^2 to its square root, as llama.cpp does
    out["dp_rms_se"] = float(dp2.std(ddof=1) / np.sqrt(n) / (2.0 * rms)) if n > 1 and rms > 0 else 0.0
    out |= {f"dp_{k}": v for k, v in _percentiles(stats.dp, DP_PERCENTILES).items()}
    out["overlap_mean"] = float(stats.overlap.mean())
    absd = np.abs(stats.dlogprob)
    out["dlogprob_abs_mean"] = float(absd.mean(dtype=np.float64))
    out["dlogprob_abs_max"] = float(absd.max())
    return out


# --- per-sequence reductions over flat per-step arrays split by `offsets` [S+1] ---


def segment_sum(x: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """float64 [S]: sum of x over each segment (0 for empty segments)."""
    starts, ends = offsets[:-1], offsets[1:]
    out = np.zeros(starts.shape[0], np.float64)
    nonempty = ends > starts
    if nonempty.any():
        # reduceat over the non-empty starts: segments are contiguous, so each
        # non-empty segment runs exactly to the next non-empty start
        out[nonempty] = np.add.reduceat(x, starts[nonempty], dtype=np.float64)
    return out


def segment_max(x: np.ndarray, offsets: np.ndarray, *, empty: float = -np.inf) -> np.ndarray:
    """float64 [S]: max of x over each segment (`empty` for empty segments)."""
    starts, ends = offsets[:-1], offsets[1:]
    out = np.full(starts.shape[0], empty, np.float64)
    nonempty = ends > starts
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(x, starts[nonempty])  # as in segment_sum
    return out


def segment_first(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """int64 [S]: local index of the first True in each segment, -1 where none."""
    out = np.full(offsets.shape[0] - 1, -1, np.int64)
    where = np.flatnonzero(flags)
    if where.size:
        seg = np.searchsorted(offsets, where, side="right") - 1
        first = np.concatenate([[True], seg[1:] != seg[:-1]])
        out[seg[first]] = where[first] - offsets[seg[first]]
    return out


# --- change detectors over one sequence's per-step curve ---


@dataclass(frozen=True)
class ChangePoint:
    """Where a per-step curve left its baseline: `onset` (first step of the change)
    and `alarm` (step at which the evidence became conclusive)."""

    onset: int
    alarm: int


def cusum(
    x: np.ndarray, *, baseline: float, drift: float, threshold: float, step_cap: float = np.inf
) -> ChangePoint | None:
    """One-sided CUSUM for an upward shift of x above `baseline`.

    S_t = max(0, S_{t-1} + min(x_t - baseline - drift, step_cap)); alarm at the first t
    with S_t > threshold; onset = the step after S last sat at 0 before the alarm (the
    maximum-likelihood change point for a mean shift). `drift` is the allowance a
    healthy curve may exceed the baseline by without accumulating evidence; `step_cap`
    bounds what one step can add, so a single outlier cannot alarm alone. Computed in
    closed form: S_t = C_t - min_{j<=t} C_j with C the cumulative sum (C_0 = 0).
    """
    y = np.minimum(np.minimum(np.asarray(x, np.float64), NLL_CAP) - (baseline + drift), step_cap)
    if y[y > 0].sum() <= threshold:  # S_t never exceeds the total positive evidence
        return None
    c = np.concatenate([[0.0], np.cumsum(y)])
    running_min = np.minimum.accumulate(c)
    s = c[1:] - running_min[1:]
    over = np.flatnonzero(s > threshold)
    if over.size == 0:
        return None
    alarm = int(over[0])
    low = running_min[alarm + 1]
    head = c[: alarm + 1]
    onset = alarm - int(np.argmax(head[::-1] == low))  # last time S was 0
    return ChangePoint(onset=onset, alarm=alarm)


def persistent_onset(flags: np.ndarray, *, window: int, fraction: float) -> int | None:
    """First step t that is flagged and starts a window of `window` steps (cut at the
    end of the curve) of which at least `fraction` are flagged. A window cut below half
    its length by the end of the curve cannot start persistence, so one flag on the
    last steps does not count as persistent."""
    flags = np.asarray(flags, bool)
    n = flags.shape[0]
    if n == 0 or not flags.any():
        return None
    t = np.arange(n)
    end = np.minimum(t + window, n)
    width = end - t
    cs = np.concatenate([[0], np.cumsum(flags)])
    count = cs[end] - cs[t]
    min_width = min(max(1, -(-window // 2)), n)
    ok = flags & (width >= min_width) & (count >= fraction * width)
    hit = np.flatnonzero(ok)
    return int(hit[0]) if hit.size else None
