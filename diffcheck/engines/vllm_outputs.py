"""vLLM's per-step logprob dicts as diffcheck's dense `Steps` columns."""

from __future__ import annotations

import numpy as np

from diffcheck.types import Steps


def steps_from_logprobs(tokens: list[int], logprobs, k: int) -> dict[str, np.ndarray]:
    """vLLM's per-step {token_id: Logprob} dicts -> dense arrays (top-k in rank order)."""
    n = len(tokens)
    lp = np.full(n, np.nan, np.float32)
    ids = np.full((n, k), -1, np.int32)
    lps = np.full((n, k), -np.inf, np.float32)
    for t in range(n):
        entry = logprobs[t] if logprobs is not None and t < len(logprobs) else None
        if not entry:
            continue
        own = entry.get(tokens[t])
        if own is not None:
            lp[t] = own.logprob
        ranked = sorted(((v.rank, tid, v.logprob) for tid, v in entry.items() if v.rank is not None and v.rank <= k))
        for j, (_rank, tid, value) in enumerate(ranked[:k]):
            ids[t, j] = tid
            lps[t, j] = value
    return {"token_id": np.asarray(tokens, np.int32), "logprob": lp, "topk_ids": ids, "topk_logprobs": lps}


def concat(parts: list[dict[str, np.ndarray]], k: int) -> Steps:
    """Per-sequence arrays from `steps_from_logprobs` -> one `Steps` table, sequences in order."""
    if not parts:
        return Steps.empty(k)
    seq = np.concatenate([np.full(len(p["token_id"]), i, np.int32) for i, p in enumerate(parts)])
    step = np.concatenate([np.arange(len(p["token_id"]), dtype=np.int32) for p in parts])
    return Steps(seq=seq, step=step, token_id=np.concatenate([p["token_id"] for p in parts]),
                 logprob=np.concatenate([p["logprob"] for p in parts]),
                 topk_ids=np.concatenate([p["topk_ids"] for p in parts]),
                 topk_logprobs=np.concatenate([p["topk_logprobs"] for p in parts]))
