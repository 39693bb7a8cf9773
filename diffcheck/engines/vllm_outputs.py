"""vLLM's per-step logprobs as diffcheck's dense `Steps` columns.

vLLM hands logprobs back in one of two containers: a list of ``{token_id: Logprob}``
dicts (its default), or a ``FlatLogprobs`` (``SamplingParams(flat_logprobs=True)``):
flat lists of token ids, logprobs and ranks with per-position start and end indices,
a constant number of Python objects however long the run. The engine asks for the flat
one where its vLLM has it (the capture's host-side cost, docs/gpu.md); both convert here.

Every engine builds its `Steps` through `concat`, which keeps logprobs in their stored
form (`storage.codec`, 6 mantissa bits): a run is judged as it is stored, so a verdict
taken live is the verdict a re-judging of the stored files gives. Judging the engine's
float32 against a stored golden would read the codec's rounding (up to 0.83 % of a
logprob) as a difference between engines.
"""

from __future__ import annotations

import numpy as np

from diffcheck.core.types import Steps
from diffcheck.storage.codec import quantize_logprobs


def steps_from_logprobs(tokens: list[int], logprobs, k: int) -> dict[str, np.ndarray]:
    """vLLM's per-step logprobs (dicts or FlatLogprobs) -> dense arrays (top-k in rank order)."""
    if logprobs is not None and hasattr(logprobs, "start_indices"):
        dense = _from_flat(tokens, logprobs, k)
        if dense is not None:
            return dense
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


def _from_flat(tokens: list[int], flat, k: int) -> dict[str, np.ndarray] | None:
    """The sampled-logprob layout without a Python loop per step, or None for anything else.

    For sampled tokens vLLM stores, per position, the sampled token first (with its rank)
    and then its top-k in rank order 1..k: k + 1 entries. Positions laid out any other
    way (fewer entries, prompt logprobs) return None and take the general path.
    """
    n = len(tokens)
    width = k + 1
    if n == 0 or len(flat.start_indices) < n:
        return None
    starts = np.asarray(flat.start_indices[:n], np.int64)
    ends = np.asarray(flat.end_indices[:n], np.int64)
    if not (np.all(ends - starts == width) and np.all(np.diff(starts) == width)):
        return None
    lo, hi = int(starts[0]), int(starts[0]) + n * width
    ids = np.asarray(flat.token_ids[lo:hi], np.int64).reshape(n, width)
    ranks = flat.ranks[lo:hi]
    if any(r is None for r in ranks):
        return None
    ranks = np.asarray(ranks, np.int64).reshape(n, width)
    token_ids = np.asarray(tokens, np.int64)
    if not (np.array_equal(ids[:, 0], token_ids) and np.all(ranks[:, 1:] == np.arange(1, width))):
        return None
    values = np.asarray(flat.logprobs[lo:hi], np.float32).reshape(n, width)
    return {"token_id": token_ids.astype(np.int32), "logprob": values[:, 0].copy(),
            "topk_ids": ids[:, 1:].astype(np.int32), "topk_logprobs": values[:, 1:].copy()}


def concat(parts: list[dict[str, np.ndarray]], k: int) -> Steps:
    """Per-sequence arrays from `steps_from_logprobs` -> one `Steps` table, sequences in order,
    logprobs in their stored form (see the module's docstring)."""
    if not parts:
        return Steps.empty(k)
    seq = np.concatenate([np.full(len(p["token_id"]), i, np.int32) for i, p in enumerate(parts)])
    step = np.concatenate([np.arange(len(p["token_id"]), dtype=np.int32) for p in parts])
    return Steps(seq=seq, step=step, token_id=np.concatenate([p["token_id"] for p in parts]),
                 logprob=quantize_logprobs(np.concatenate([p["logprob"] for p in parts])),
                 topk_ids=np.concatenate([p["topk_ids"] for p in parts]),
                 topk_logprobs=quantize_logprobs(np.concatenate([p["topk_logprobs"] for p in parts])))
