"""Bytes per generated token of stored runs (goal: <= 48 at top-20), and store throughput.

Synthetic runs have the shape of real LLM top-k data: ids are Zipf-distributed
with a few hundred hot tokens (punctuation, common words) and, as in BPE
vocabularies, roughly ordered by frequency (id ~ frequency rank, shuffled within
blocks of 256); 40 % of candidates come from a per-stretch set of 400 topic
tokens; 12 % of each step's top-k reappears at the next step (fitted to a real
SmolLM2 golden: ~2 ids per 20 shared with the previous step, ~10 bits/id);
logprobs are sorted descending, with confident and uncertain steps; the
sampled token is mostly rank 0; text is ~4.2 characters per token.

Every real run file under goldens/*/*.parquet is re-encoded with this diffcheck's
writer into a temp folder (the files themselves are not touched) and measured
the same way. Files of schema 1 (float16 logprobs, which store.py refuses) are
loaded here with plain pyarrow so that they can be measured too.

bytes/token = file bytes / n_tokens, split into step data (seq .. topk_logprob_gaps),
per-sequence data (prompt ids, text, ...) and the rest (footer, run meta JSON).

Precision: for each real golden, also the size at 5 and 7 mantissa bits and the
top-k KL that classify.py computes between the golden and a copy with Gaussian
noise on its logprobs (1e-3 and 1e-2 nats), unquantized against stored at each
precision and on an absolute 1/64-nat grid. Schema-1 values are already rounded
to 7 bits; they are spread uniformly within their rounding cell first so that
the coarser codes see realistic values.

    python bench/bench_store.py [--tokens N] [--sequences S] [--k K] [--goldens GLOB]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffcheck.storage import store, codec as store_format  # noqa: E402
from diffcheck.core.types import Run, RunMeta, SequenceInfo, Steps  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402

VOCAB = 49152  # SmolLM2's
WORDS = ("the of and to in a is that for it as with was on be by this are or from at which an have not "
         "inference engine kernel graph replay decode attention metadata buffer tensor parallel output quality "
         "regression test golden reference candidate token step divergence sequence latency throughput").split()


def synthetic_steps(n_steps: int, *, k: int = 20, seed: int = 0, n_hot: int = 300, reuse: float = 0.12,
                    zipf_a: float = 1.1, block: int = 256, topic: float = 0.4, topic_size: int = 400,
                    topic_every: int = 192):
    """(token_id, logprob, topk_ids, topk_logprobs) with realistic redundancy (see module docstring)."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    weight = ranks ** -zipf_a
    weight[:n_hot] *= 3.0  # a few hundred hot tokens carry most of the mass
    cdf = np.cumsum(weight) / weight.sum()
    # BPE ids are assigned in merge order, which roughly follows frequency.
    id_of_rank = np.concatenate([rng.permutation(np.arange(i, min(i + block, VOCAB))) for i in range(0, VOCAB, block)])
    draws = id_of_rank[np.minimum(np.searchsorted(cdf, rng.random((n_steps, 3 * k))), VOCAB - 1)].astype(np.int32)
    # Topic words: each stretch of text keeps proposing the same few hundred content tokens.
    n_topics = -(-n_steps // topic_every)
    topics = id_of_rank[np.minimum(np.searchsorted(cdf, rng.random((n_topics, topic_size)) * (1 - cdf[n_hot]) + cdf[n_hot]),
                                   VOCAB - 1)]
    from_topic = rng.random((n_steps, 3 * k)) < topic
    pick = topics[np.arange(n_steps)[:, None] // topic_every, rng.integers(0, topic_size, (n_steps, 3 * k))]
    draws = np.where(from_topic, pick, draws).astype(np.int32)
    ids = np.empty((n_steps, k), np.int32)
    prev = draws[0, :k]
    keep = rng.random((n_steps, k)) < reuse
    for t in range(n_steps):
        row = list(dict.fromkeys([int(x) for x in prev[keep[t]]] + draws[t].tolist()))[:k]
        while len(row) < k:  # rare: too many duplicates among the draws
            x = int(id_of_rank[min(int(np.searchsorted(cdf, rng.random())), VOCAB - 1)])
            if x not in row:
                row.append(x)
        ids[t] = rng.permutation(row)
        prev = ids[t]
    confident = rng.random(n_steps) < 0.5
    top1 = -rng.exponential(0.02, n_steps) - np.where(confident, 0.0, rng.exponential(0.6, n_steps))
    gaps = rng.gamma(2.0, 0.35, (n_steps, k - 1)) * (0.15 + 0.8 * rng.random((n_steps, 1)))
    gaps[:, 0] *= np.where(confident, 6.0, 1.0)  # confident steps: a wide margin to rank 2
    lp = np.concatenate([top1[:, None], top1[:, None] - np.cumsum(gaps, axis=1)], axis=1).astype(np.float32)
    rank = np.minimum(rng.geometric(0.6, n_steps) - 1, k - 1)
    rows = np.arange(n_steps)
    return ids[rows, rank], lp[rows, rank], ids, lp


def synthetic_run(n_tokens: int = 16384, *, sequences: int = 8, k: int = 20, seed: int = 0) -> Run:
    rng = np.random.default_rng(seed + 1)
    counts = np.full(sequences, n_tokens // sequences)
    counts[: n_tokens - counts.sum()] += 1
    token, logprob, topk_ids, topk_lp = synthetic_steps(int(counts.sum()), k=k, seed=seed)
    seqs = []
    for i, n in enumerate(counts):
        words, chars = [], 0
        while chars < 4.2 * n:  # ~4.2 characters per token, as English BPE text
            w = WORDS[int(rng.integers(len(WORDS)))]
            words.append(w)
            chars += len(w) + 1
        seqs.append(SequenceInfo(prompt_id=f"p{i}", prompt_token_ids=tuple(int(x) for x in rng.integers(0, VOCAB, 40)),
                                 text=" ".join(words), finish_reason="length", n_tokens=int(n)))
    meta = RunMeta(
        suite="bench", case_id="J", role="reference", kind="generate",
        engine={"name": "vllm", "version": "0.32.0", "commit": "0" * 40, "dirty": False,
                "effective": {"dtype": "float32", "enforce_eager": True, "cudagraph_mode": "NONE",
                              "attention_backend": "CPU_ATTN", "max_model_len": 4096}},
        model={"id": "smollm2-135m", "path": "/cache/models/smollm2-135m", "digest": "f" * 64},
        sampling={"max_tokens": int(counts.max()), "temperature": 1.0, "top_p": 0.95, "top_k": 20, "seed": 1234,
                  "logprobs": k},
        hardware={"cpu": "synthetic", "cores": 2}, timings={"generate_s": 10.0}, created="2026-12-01T00:00:00+00:00",
        diffcheck_version="bench",
    )
    return Run(meta=meta, sequences=tuple(seqs), steps=Steps(
        seq=np.repeat(np.arange(sequences, dtype=np.int32), counts),
        step=np.concatenate([np.arange(n, dtype=np.int32) for n in counts]),
        token_id=token, logprob=logprob, topk_ids=topk_ids, topk_logprobs=topk_lp))


def split_bytes(path: Path, n_tokens: int) -> dict[str, float]:
    """bytes/token of the file: total, step data, per-sequence data, the rest; and per column."""
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    cols: dict[str, int] = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            name = rg.column(c).path_in_schema.split(".")[0]
            cols[name] = cols.get(name, 0) + rg.column(c).total_compressed_size
    size = path.stat().st_size
    step = sum(v for k, v in cols.items() if k in store_format.STEP_COLUMNS)
    seqs = sum(v for k, v in cols.items() if k in store_format.SEQUENCE_COLUMNS)
    return {"total": size / n_tokens, "step_data": step / n_tokens, "sequence_data": seqs / n_tokens,
            "footer_and_meta": (size - step - seqs) / n_tokens,
            "columns": {k: round(v / n_tokens, 2) for k, v in cols.items()}}


def measure(run: Run, folder: Path) -> dict:
    path = store.run_path(folder, run.meta.suite, run.meta.case_id, kind=run.meta.kind, role=run.meta.role,
                          reference=(run.meta.source or {}).get("reference_case") or "ref")
    t0 = time.perf_counter()
    store.write_run(path, run)
    t1 = time.perf_counter()
    again = store.read_run(path)
    t2 = time.perf_counter()
    n = run.n_tokens
    return {"tokens": n, "k": run.steps.k, **split_bytes(path, n),
            "write_tokens_per_s": n / (t1 - t0), "read_tokens_per_s": n / (t2 - t1),
            "digest_roundtrip": store.content_digest(again) == store.content_digest(run)}


def load_schema1(path: str) -> Run:
    """A schema-1 file (float16 logprobs, sequences as JSON metadata), read with plain pyarrow."""
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    kv = t.schema.metadata
    meta = RunMeta(**json.loads(kv[b"diffcheck.meta"]))
    k = json.loads(kv[b"diffcheck.layout"])["k"]
    seqs = tuple(SequenceInfo(prompt_id=r["prompt_id"], prompt_token_ids=tuple(r["prompt_token_ids"]), text=r["text"],
                              finish_reason=r["finish_reason"], n_tokens=r["n_tokens"])
                 for r in json.loads(kv[b"diffcheck.sequences"]))

    def flat(name, dtype, width=None):
        arr = t[name].combine_chunks()
        if width is not None:
            arr = arr.flatten()
        out = np.asarray(arr.to_numpy(zero_copy_only=False)).astype(dtype)
        return out.reshape(t.num_rows, width) if width is not None else out

    return Run(meta=meta, sequences=seqs, steps=Steps(
        seq=flat("seq", np.int32), step=flat("step", np.int32), token_id=flat("token_id", np.int32),
        logprob=flat("logprob", np.float32), topk_ids=flat("topk_ids", np.int32, k),
        topk_logprobs=flat("topk_logprobs", np.float32, k)))


def spread_schema1(x: np.ndarray, rng) -> np.ndarray:
    """Schema-1 values spread uniformly within their 7-bit rounding cell (order kept per row)."""
    x = x.astype(np.float64)
    ok = np.isfinite(x) & (x != 0)
    cell = 2.0 ** (np.floor(np.log2(np.abs(np.where(ok, x, 1.0)))) - 7)
    y = np.where(ok, x + rng.uniform(-0.5, 0.5, x.shape) * cell, x).astype(np.float32)
    return -np.sort(-y, axis=1) if y.ndim == 2 else y


def with_mantissa_bits(bits: int, fn):
    saved = store_format.LOGPROB_MANTISSA_BITS
    store_format.LOGPROB_MANTISSA_BITS = bits
    try:
        return fn()
    finally:
        store_format.LOGPROB_MANTISSA_BITS = saved


def kl_fidelity(run: Run, *, seed: int = 1) -> dict:
    """Mean top-k KL (classify.py's) between the run and a noisy copy: unquantized, at each precision."""
    from diffcheck.judging import stats

    rng = np.random.default_rng(seed)
    ids, lr = run.steps.topk_ids, run.steps.topk_logprobs
    out = {}
    for sigma in (1e-3, 1e-2):
        lc = (lr + rng.normal(0, sigma, lr.shape)).astype(np.float32)
        row = {"unquantized": float(stats.topk_kl(ids, lr, ids, lc).mean())}
        for bits in (5, 6, 7):
            q = lambda x: with_mantissa_bits(bits, lambda: store_format.quantize_logprobs(x))  # noqa: E731
            row[f"{bits} bits"] = float(stats.topk_kl(ids, q(lr), ids, q(lc)).mean())
        grid = lambda x: (np.rint(x.astype(np.float64) * 64) / 64).astype(np.float32)  # noqa: E731
        row["1/64 grid"] = float(stats.topk_kl(ids, grid(lr), ids, grid(lc)).mean())
        out[sigma] = row
    return out


def real_goldens(pattern: str = "goldens/*/*.parquet") -> dict:
    out = {}
    rng = np.random.default_rng(0)
    for p in sorted(glob.glob(pattern)):
        try:
            run, schema = store.read_run(p, verify=False), store.SCHEMA_VERSION
        except Exception as exc:  # noqa: BLE001 - measure what can be measured, report the rest
            if "older diffcheck" not in str(exc):
                out[p] = {"skipped": str(exc)}
                continue
            run, schema = load_schema1(p), 1
        if not run.n_tokens:
            continue
        if schema == 1:
            run = dataclasses.replace(run, steps=dataclasses.replace(
                run.steps, topk_logprobs=spread_schema1(run.steps.topk_logprobs, rng),
                logprob=spread_schema1(run.steps.logprob, rng)))
        r = {"schema": schema, "stored_bytes_per_token": os.path.getsize(p) / run.n_tokens}
        with tempfile.TemporaryDirectory() as tmp:
            r["now"] = measure(run, Path(tmp))
            for bits in (5, 7):
                r[f"{bits}_bits"] = with_mantissa_bits(bits, lambda: measure(run, Path(tmp) / f"m{bits}"))["total"]
        if run.meta.kind == "generate" and run.meta.role == "reference":
            r["kl"] = kl_fidelity(run)
        out[p] = r
    return out


def _line(r: dict) -> str:
    return (f"{r['total']:.1f} bytes/token = step data {r['step_data']:.1f} + per-sequence {r['sequence_data']:.1f} "
            f"+ footer/meta {r['footer_and_meta']:.1f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--goldens", default="goldens/*/*.parquet", help="glob of real run files to re-encode")
    args = ap.parse_args(argv)
    run = synthetic_run(args.tokens, sequences=args.sequences, k=args.k)
    bits = store_format.LOGPROB_MANTISSA_BITS
    results: dict = {"goal_bytes_per_token": 48, "logprob_mantissa_bits": bits}
    with tempfile.TemporaryDirectory() as tmp:
        results["synthetic"] = syn = measure(run, Path(tmp))
        for b in (5, 7):
            results[f"synthetic_{b}_bits"] = with_mantissa_bits(b, lambda: measure(run, Path(tmp) / f"m{b}"))["total"]
    results["real_goldens"] = real_goldens(args.goldens)
    print(f"goal <= 48 bytes/token at K=20; logprobs coded with {bits} mantissa bits")
    print(f"synthetic run: {syn['tokens']} tokens, K={syn['k']}: {_line(syn)}; "
          f"{results['synthetic_5_bits']:.1f} at 5 bits, {results['synthetic_7_bits']:.1f} at 7")
    print("  per column: " + ", ".join(f"{k} {v}" for k, v in syn["columns"].items()))
    print(f"  write {syn['write_tokens_per_s'] / 1e3:.0f}k tokens/s, read {syn['read_tokens_per_s'] / 1e3:.0f}k tokens/s, "
          f"digest round trip {'ok' if syn['digest_roundtrip'] else 'BROKEN'}")
    if not results["real_goldens"]:
        print(f"real goldens: none match {args.goldens}")
    for p, r in results["real_goldens"].items():
        if "skipped" in r:
            print(f"{p}: skipped ({r['skipped'][:100]})")
            continue
        now = r["now"]
        print(f"{p} (schema {r['schema']}, {r['stored_bytes_per_token']:.1f} bytes/token as stored), {now['tokens']} "
              f"tokens re-encoded: {_line(now)}; {r['5_bits']:.1f} at 5 bits, {r['7_bits']:.1f} at 7")
        print("  per column: " + ", ".join(f"{k} {v}" for k, v in now["columns"].items()))
        for sigma, row in r.get("kl", {}).items():
            print(f"  mean top-k KL vs a copy with {sigma:g}-nat noise: "
                  + ", ".join(f"{k} {v:.2e}" for k, v in row.items()))
    return results


if __name__ == "__main__":
    main()
