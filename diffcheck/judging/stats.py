"""Per-step comparison of two next-token distributions seen in the same context.

Knows the step columns of runs (`types.Steps`) and numpy; nothing about verdicts,
tolerances, engines or text. Callers pick the row pairs that share a context
(reference vs candidate before t*, reference vs forced at every step) and get per-step
curves (`StepStats`, from `compare_steps`), llama.cpp-style summaries (`summarize`)
and per-sequence reductions (`segment_*`).

Per-step quantities, for a row pair (reference r, candidate c) with the same context
and the same token (the reference's):

- ``dlogprob`` = logprob_c(token) - logprob_r(token) (nats).
- ``dp`` = p_c(token) - p_r(token): llama.cpp's Δp of the "correct" token.
- ``top1``: the two argmax ids agree.  ``overlap``: |top-k_r ∩ top-k_c| / K.
- ``kl``: KL(reference || candidate) estimated from the two top-K lists
  (`diffcheck.judging.kl_estimator`, which documents the estimator and its bias).

Speed: `compare_steps` runs the estimator's passes in row chunks of
`kl_estimator.CHUNK_ROWS` on `WORKERS` threads (numpy releases the GIL).

The change detectors the judge runs on these curves (`cusum`, `persistent_onset`,
`NLL_CAP`) live in `diffcheck.judging.changepoint`; they and `topk_kl` are also
importable from here, where `judge` and `signals` take them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from diffcheck.core.types import Steps
from diffcheck.judging.changepoint import NLL_CAP, ChangePoint, cusum, persistent_onset  # noqa: F401  (importable here)
from diffcheck.judging.kl_estimator import CHUNK_ROWS, fast_chunk, general_rows, topk_kl  # noqa: F401

WORKERS = min(4, os.cpu_count() or 1)  # threads for the chunk loop of compare_steps

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
            kl[a:b], overlap[a:b], bad = fast_chunk(ids_r_all[sr], lr_all[sr], ids_c_all[sc], lc_all[sc], need)
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
        general_rows(ids_r_all, lr_all, ids_c_all, lc_all, rows_r, rows_c, kl, overlap, rows)
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
