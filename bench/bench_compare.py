"""Offline compare throughput: align + per-step stats + classify, no engine.

Builds a synthetic golden and candidate of >= 1M tokens with K=20 top logprobs, shaped
like a real sampled run: most sequences identical with tiny logprob noise (so some
low-rank top-K entries swap order), some drifting after a near-tie flip, a few turning
into confident garbage. Times `classify.compare_runs` three ways (candidate only, with
the reference's scoring, with scoring and forced replay), each without and with the
seed's text metrics (per-character Python, `diffcheck.judging.quality`), and prints tokens/s.

    python bench/bench_compare.py [--sequences 2000] [--steps 512] [--repeat 3] [--noise 1e-3] [--workers N]

The goal: >= 5 million candidate tokens/s on the 2-core dev machine (the core column).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from diffcheck.judging import classify, stats
from diffcheck.core.types import Run, RunMeta, SequenceInfo, Steps

K = 20
VOCAB = 49152
WORDS = ("the", "model", "cache", "graph", "kernel", "decode", "token", "step", "batch", "layer", "of", "and")


def _topk_rows(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n rows of K descending logprobs (tail mass 1-30%) over random ids."""
    logits = np.sort(rng.gumbel(size=(n, K)).astype(np.float32) * 1.5, axis=1)[:, ::-1]
    tail = rng.uniform(0.01, 0.3, size=(n, 1)).astype(np.float32)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs *= (1 - tail) / probs.sum(1, keepdims=True)
    ids = rng.integers(0, VOCAB, size=(n, K), dtype=np.int32)
    return ids, np.log(probs).astype(np.float32)


def _jitter(rng, ids, lps, scale: float):
    """Same distribution plus numeric noise; re-sort so near-equal entries may swap."""
    noisy = lps + rng.normal(0, scale, lps.shape).astype(np.float32)
    order = np.argsort(-noisy, axis=1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(noisy, order, 1)


def _sample(rng, ids, lps):
    """Sampled token per row: rank 0 most of the time, else a random top-5 rank."""
    rank = np.where(rng.random(ids.shape[0]) < 0.6, 0, rng.integers(1, 5, ids.shape[0]))
    rows = np.arange(ids.shape[0])
    return ids[rows, rank], lps[rows, rank], rank


def _text(rng, n_tokens: int, digits: bool) -> str:
    if digits:
        return " ".join(str(x) for x in rng.integers(0, 10**6, n_tokens // 2))
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_tokens))


def _run(kind: str, role: str, infos, seq, step, tok, lp, ids, lps) -> Run:
    steps = Steps(seq=seq, step=step, token_id=tok, logprob=lp, topk_ids=ids, topk_logprobs=lps)
    return Run(meta=RunMeta(suite="bench", case_id=role, role=role, kind=kind), sequences=tuple(infos), steps=steps)


def synthesize(n_seq: int, n_steps: int, *, seed: int = 0, noise: float = 1e-3, drift_fraction=0.15,
               garbage_fraction=0.05):
    """(reference, candidate, scored, forced) runs of n_seq x n_steps tokens each.
    `noise`: logprob noise of the candidate in the same context (1e-3: ~5% of rows have
    their top-K order changed; 1e-2: ~25%)."""
    rng = np.random.default_rng(seed)
    n = n_seq * n_steps
    seq = np.repeat(np.arange(n_seq, dtype=np.int32), n_steps)
    step = np.tile(np.arange(n_steps, dtype=np.int32), n_seq)
    r_ids, r_lps = _topk_rows(rng, n)
    r_tok, r_lp, r_rank = _sample(rng, r_ids, r_lps)
    c_ids, c_lps = _jitter(rng, r_ids, r_lps, noise)  # same context: numeric noise only
    c_tok, c_lp = r_tok.copy(), r_lp + rng.normal(0, noise, n).astype(np.float32)
    s_lp = r_lp.copy()  # the reference's logprob of the candidate's tokens
    f_ids, f_lps = _jitter(rng, r_ids, r_lps, noise)  # candidate forced along the reference
    f_lp = r_lp + rng.normal(0, noise, n).astype(np.float32)
    kind = rng.choice(3, n_seq, p=[1 - drift_fraction - garbage_fraction, drift_fraction, garbage_fraction])
    ref_info, cand_info = [], []
    for i in range(n_seq):
        a, b = i * n_steps, (i + 1) * n_steps
        text = _text(rng, n_steps, digits=False)
        ref_info.append(SequenceInfo(f"p{i}", (1, 2, 3), text, "length", n_steps))
        cand_text = text
        if kind[i]:
            t = a + int(rng.integers(n_steps // 8, n_steps // 2))
            # flip at t*: a sampler landing near a CDF boundary takes the next-ranked token
            rank = r_rank[t] + 1
            c_tok[t], c_lp[t], s_lp[t] = r_ids[t, rank], r_lps[t, rank], r_lps[t, rank]
            new_ids, new_lps = _topk_rows(rng, b - t - 1)
            c_ids[t + 1:b], c_lps[t + 1:b] = new_ids, new_lps
            if kind[i] == 1:  # healthy continuation in a new context
                c_tok[t + 1:b], c_lp[t + 1:b], _ = _sample(rng, new_ids, new_lps)
                s_lp[t + 1:b] = c_lp[t + 1:b] + rng.normal(0, 0.3, b - t - 1).astype(np.float32)
                cand_text = _text(rng, n_steps, digits=False)
            else:  # confident garbage, visible on the forced path a few steps earlier
                c_tok[t + 1:b] = c_ids[t + 1:b, 0]
                c_lps[t + 1:b, 0] = -0.01
                c_lp[t + 1:b] = -0.01
                s_lp[t + 1:b] = -12.0
                f_lp[t - 5:b] = r_lp[t - 5:b] - 6.0
                cand_text = _text(rng, n_steps, digits=True)
        cand_info.append(SequenceInfo(f"p{i}", (1, 2, 3), cand_text, "length", n_steps))
    reference = _run("generate", "reference", ref_info, seq, step, r_tok, r_lp, r_ids, r_lps)
    candidate = _run("generate", "candidate", cand_info, seq, step, c_tok, c_lp, c_ids, c_lps)
    scored = _run("scored", "candidate", cand_info, seq, step, c_tok, s_lp, r_ids, r_lps)
    forced = _run("forced", "candidate", ref_info, seq, step, r_tok, f_lp, f_ids, f_lps)
    return reference, candidate, scored, forced


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--noise", type=float, default=1e-3, help="same-context logprob noise")
    parser.add_argument("--workers", type=int, default=None, help="threads for per-step stats (default: stats.WORKERS)")
    args = parser.parse_args(argv)
    if args.workers is not None:
        stats.WORKERS = args.workers
    reference, candidate, scored, forced = synthesize(args.sequences, args.steps, noise=args.noise)
    n = candidate.n_tokens
    reordered = float((reference.steps.topk_ids != forced.steps.topk_ids).any(1).mean())
    verdict = classify.compare_runs(reference, candidate, scored=scored, forced=forced)
    results: dict = {"tokens": n, "k": K, "workers": stats.WORKERS, "counts": verdict.summary["counts"],
                     "reordered_rows": reordered}
    inputs = {
        "candidate": {},
        "candidate+scored": {"scored": scored},
        "candidate+scored+forced": {"scored": scored, "forced": forced},
    }
    print(f"offline compare, {n:,} tokens ({args.sequences} sequences x {args.steps} steps, K={K}, "
          f"{stats.WORKERS} threads), "
          f"{reordered:.0%} of same-context rows with a reordered top-K; verdicts {verdict.summary['counts']}")
    print(f"  {'':<25} {'core (no text metrics)':>30} {'with text metrics':>30}")
    for name, extra in inputs.items():
        core = _time(lambda: classify.compare_runs(reference, candidate, text_metrics=False, **extra), args.repeat)
        full = _time(lambda: classify.compare_runs(reference, candidate, **extra), args.repeat)
        results[name] = {"core_seconds": core, "core_tokens_per_s": n / core,
                         "seconds": full, "tokens_per_s": n / full}
        print(f"  {name:<25} {core * 1e3:9.1f} ms {n / core / 1e6:7.2f} M tokens/s "
              f"{full * 1e3:9.1f} ms {n / full / 1e6:7.2f} M tokens/s")
    return results


if __name__ == "__main__":
    main()
