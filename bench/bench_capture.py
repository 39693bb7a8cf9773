"""The host-side cost of top-k logprob capture in vLLM's front end, before and after.

Under FULL decode CUDA graphs the GPU decodes a token in well under a millisecond, so
what vLLM's front-end process does per generated token shows in tokens/s. With
``logprobs=20`` that is, per step and sequence: its ``LogprobsProcessor`` turns the
sampler's row (the sampled token and its top 20) into Python objects, and with
detokenization on it also decodes each of the 21 candidates into a string; afterwards
diffcheck converts the logprobs into its dense columns.

This benchmark runs that code itself, vLLM's own ``LogprobsProcessor`` with SmolLM2's
real tokenizer, on 4 sequences x 256 steps (1024 tokens) of synthetic sampler rows fed
step by step as in a batch, and compares:

- **before**: vLLM's defaults as diffcheck used them (a dict of ``Logprob`` per step,
  every candidate detokenized), then `steps_from_logprobs` over the dicts, plus vLLM's
  incremental detokenizer for the text (the tokenizers ``DecodeStream``, which vLLM's
  fast detokenizer uses);
- **after**: what the engine asks for now (``flat_logprobs=True``, ``detokenize=False``),
  the flat conversion, and the text decoded once per sequence;
- **text only**: the incremental detokenizer alone: what a run without logprobs pays.

Rounds interleave the three; medians of the per-round seconds per 1024 tokens. This is
the CPU of this machine, not the GPU host: the ratio, not the milliseconds, carries over.
The GPU-side cost of computing the top-k and its transfer is not in it (tools/gpu/speed.py
measures the whole on the H200).

Run: ``.venv/bin/python bench/bench_capture.py [ROUNDS]`` (about 20 s). Needs the model
(``diffcheck model prepare``) for its tokenizer.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

K = 20
SEQUENCES = 4
STEPS = 256
VOCAB = 49152
TEXT = ("The lighthouse keeper climbed the stairs every evening, lit the lamp and watched the ships "
        "pass the rocks. A bicycle turns the force of your legs into motion through pedals, a chain "
        "and gears; the wheels keep it upright while it rolls. ")


def _rows(tokenizer, seed: int = 0):
    """Per sequence: sampled ids (real text), [steps, K + 1] ids and logprobs, ranks."""
    rng = np.random.default_rng(seed)
    text_ids = tokenizer.encode(TEXT * 40, add_special_tokens=False)
    out = []
    for s in range(SEQUENCES):
        sampled = np.asarray(text_ids[s * STEPS:(s + 1) * STEPS], np.int64)
        top = rng.integers(0, VOCAB, size=(STEPS, K))
        top[:, 0] = sampled  # greedy-like: the sampled token is rank 1
        ids = np.concatenate([sampled[:, None], top], axis=1)
        lps = np.concatenate([np.zeros((STEPS, 1)), -np.sort(rng.gamma(2.0, 1.5, (STEPS, K)), axis=1)], axis=1)
        lps[:, 0] = lps[:, 1]
        out.append((sampled, ids, lps.astype(np.float32), np.ones(STEPS, np.int64)))
    return out


def _processor(tokenizer, flat: bool):
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    return LogprobsProcessor(tokenizer=tokenizer, logprobs=FlatLogprobs() if flat else [], prompt_logprobs=None,
                             cumulative_logprob=0.0, num_logprobs=K, num_prompt_logprobs=None)


def _capture(rows, tokenizer, *, flat: bool, detokenize: bool, incremental_text: bool) -> float:
    from tokenizers.decoders import DecodeStream
    from vllm.v1.outputs import LogprobsLists

    from diffcheck.engines.vllm_outputs import steps_from_logprobs

    t0 = time.perf_counter()
    procs = [_processor(tokenizer if detokenize else None, flat) for _ in rows] if flat is not None else []
    streams = [DecodeStream(skip_special_tokens=True) for _ in rows] if incremental_text else []
    texts = [[] for _ in rows]
    for t in range(STEPS):
        for s, (sampled, ids, lps, ranks) in enumerate(rows):
            if procs:
                procs[s]._update_sample_logprobs(LogprobsLists(ids[t:t + 1], lps[t:t + 1], ranks[t:t + 1], None))
            if streams:
                piece = streams[s].step(tokenizer._tokenizer, int(sampled[t]))
                if piece:
                    texts[s].append(piece)
    for s, (sampled, *_rest) in enumerate(rows):
        if procs:
            steps_from_logprobs(sampled.tolist(), procs[s].logprobs, K)
        if not incremental_text:
            tokenizer.decode(sampled.tolist(), skip_special_tokens=True)
    return time.perf_counter() - t0


def main(rounds: int = 7) -> dict:
    from vllm.tokenizers import get_tokenizer

    from diffcheck.engines import models

    tokenizer = get_tokenizer(str(models.resolve("smollm2-135m").path))
    rows = _rows(tokenizer)
    tokens = SEQUENCES * STEPS
    ways = {
        "before": dict(flat=False, detokenize=True, incremental_text=True),
        "after": dict(flat=True, detokenize=False, incremental_text=False),
        "text_only": dict(flat=None, detokenize=False, incremental_text=True),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    _capture(rows, tokenizer, **ways["before"])  # warm-up: imports, tokenizer caches
    for _ in range(rounds):
        for name, how in ways.items():
            seconds[name].append(_capture(rows, tokenizer, **how))
    per_1024 = {name: statistics.median(v) * 1024 / tokens for name, v in seconds.items()}
    result = {
        "tokens": tokens, "k": K, "rounds": rounds, "seconds": seconds,
        "ms_per_1024_tokens": {name: round(v * 1e3, 2) for name, v in per_1024.items()},
        "capture_ms_per_1024_before": round((per_1024["before"] - per_1024["text_only"]) * 1e3, 2),
        "capture_ms_per_1024_after": round((per_1024["after"] - per_1024["text_only"]) * 1e3, 2),
        "before_over_after": round(per_1024["before"] / per_1024["after"], 2),
    }
    print(f"host side per 1024 tokens (median of {rounds} rounds): before {per_1024['before'] * 1e3:.1f} ms, "
          f"after {per_1024['after'] * 1e3:.1f} ms, text only {per_1024['text_only'] * 1e3:.1f} ms "
          f"({result['before_over_after']}x)", flush=True)
    return result


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
