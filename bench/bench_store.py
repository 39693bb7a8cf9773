"""Bytes per generated token of stored runs (goal: <= 48 at top-20), and store throughput.

Synthetic runs have the shape of real LLM top-k data: ids are Zipf-distributed
with a few hundred hot tokens (punctuation, common words) and, as in BPE
vocabularies, roughly ordered by frequency (id ~ frequency rank, shuffled within
blocks of 256); 40 % of candidates come from a per-stretch set of 400 topic
tokens; 12 % of each step's top-k reappears at the next step (fitted to a real
SmolLM2 golden: ~2 ids per 20 shared with the previous step, ~10 bits/id);
logprobs are sorted descending, with confident and uncertain steps; the
sampled token is mostly rank 0; text is ~4.2 characters per token. When real
goldens exist under goldens/default/*.parquet, their bytes/token is reported too.

bytes/token = file bytes / n_tokens (the whole file: columns, metadata, footer).

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

from diffcheck import store  # noqa: E402
from diffcheck.types import Run, RunMeta, SequenceInfo, Steps  # noqa: E402

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


def column_bytes(path: Path) -> dict[str, int]:
    import pyarrow.parquet as pq

    md = pq.ParquetFile(path).metadata
    out: dict[str, int] = {}
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            name = rg.column(c).path_in_schema.split(".")[0]
            out[name] = out.get(name, 0) + rg.column(c).total_compressed_size
    out["footer+metadata"] = md.serialized_size
    out["sequences json"] = len((md.metadata or {}).get(b"diffcheck.sequences", b""))
    return out


def measure(run: Run, folder: Path) -> dict:
    path = store.run_path(folder, run.meta.suite, run.meta.case_id)
    t0 = time.perf_counter()
    store.write_run(path, run)
    t1 = time.perf_counter()
    again = store.read_run(path)
    t2 = time.perf_counter()
    size = path.stat().st_size
    n = run.n_tokens
    parts = column_bytes(path)
    return {
        "tokens": n, "k": run.steps.k, "bytes": size, "bytes_per_token": size / n,
        "bytes_per_token_without_text": (size - sum(len(s.text.encode()) for s in run.sequences)) / n,
        "per_column_bytes_per_token": {name: round(b / n, 2) for name, b in parts.items()},
        "write_tokens_per_s": n / (t1 - t0), "read_tokens_per_s": n / (t2 - t1),
        "digest_roundtrip": store.content_digest(again) == store.content_digest(run),
    }


def real_goldens(pattern: str = "goldens/default/*.parquet") -> dict:
    out = {}
    for p in sorted(glob.glob(pattern)):
        if ".run." in p or ".forced-" in p or ".scored-" in p:
            continue
        try:
            run = store.read_run(p)
        except Exception as exc:  # report and go on: the bench is about size, not integrity
            out[p] = {"error": str(exc)}
            continue
        if run.n_tokens:
            out[p] = {"tokens": run.n_tokens, "k": run.steps.k, "bytes_per_token": os.path.getsize(p) / run.n_tokens,
                      "per_column_bytes_per_token": {n: round(b / run.n_tokens, 2)
                                                     for n, b in column_bytes(Path(p)).items()}}
            # The same run written with this diffcheck's encodings (the file may predate them).
            with tempfile.TemporaryDirectory() as tmp:
                again = measure(run, Path(tmp))
            out[p]["reencoded_bytes_per_token"] = again["bytes_per_token"]
            out[p]["reencoded_per_column_bytes_per_token"] = again["per_column_bytes_per_token"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--goldens", default="goldens/default/*.parquet", help="glob of real goldens to report")
    args = ap.parse_args(argv)
    run = synthetic_run(args.tokens, sequences=args.sequences, k=args.k)
    results: dict = {"goal_bytes_per_token": 48, "logprob_mantissa_bits": store.LOGPROB_MANTISSA_BITS}
    with tempfile.TemporaryDirectory() as tmp:
        results["synthetic"] = measure(run, Path(tmp))
        # What full float16 (10 mantissa bits) would cost, for the record.
        saved = store.LOGPROB_MANTISSA_BITS
        try:
            store.LOGPROB_MANTISSA_BITS = 10
            path = Path(tmp) / "full-f16.parquet"
            store.write_run(path, run)
            results["synthetic_full_float16_bytes_per_token"] = path.stat().st_size / run.n_tokens
        finally:
            store.LOGPROB_MANTISSA_BITS = saved
    results["real_goldens"] = real_goldens(args.goldens)
    syn = results["synthetic"]
    print(f"synthetic run: {syn['tokens']} tokens, K={syn['k']}: {syn['bytes_per_token']:.1f} bytes/token "
          f"({syn['bytes_per_token_without_text']:.1f} without the text) — goal <= 48")
    print("  per column (bytes/token): " + ", ".join(f"{k} {v}" for k, v in syn["per_column_bytes_per_token"].items()))
    print(f"  write {syn['write_tokens_per_s'] / 1e3:.0f}k tokens/s, read {syn['read_tokens_per_s'] / 1e3:.0f}k tokens/s, "
          f"digest round trip {'ok' if syn['digest_roundtrip'] else 'BROKEN'}")
    print(f"  full float16 logprobs instead of {store.LOGPROB_MANTISSA_BITS} mantissa bits: "
          f"{results['synthetic_full_float16_bytes_per_token']:.1f} bytes/token")
    if not results["real_goldens"]:
        print(f"real goldens: none match {args.goldens} (record them with `make golden`)")
    for p, r in results["real_goldens"].items():
        if "error" in r:
            print(f"real golden {p}: unreadable: {r['error']}")
        else:
            print(f"real golden {p}: {r['tokens']} tokens, K={r['k']}: {r['bytes_per_token']:.1f} bytes/token as stored, "
                  f"{r['reencoded_bytes_per_token']:.1f} re-encoded now; "
                  + ", ".join(f"{k} {v}" for k, v in r["reencoded_per_column_bytes_per_token"].items()))
    return results


if __name__ == "__main__":
    main()
