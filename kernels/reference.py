"""The reference decode attention: float64 on the CPU, one sequence at a time.

Knows the canonical paged layout (see `kernels.batch`) and the math of one
decode step: for each sequence, gather its first ``seq_len`` cache slots
through its block list, share each KV head among ``queries_per_kv`` query
heads (GQA), softmax(q . k * scale) . v. It reads the batch's block lists
directly, never a metadata tensor, so it cannot share a metadata bug with the
kernels under test. Inputs are the kernels' own (already rounded to their
dtype), promoted to float64: the reference error of a kernel is its own.
"""

from __future__ import annotations

import torch

from diffcheck_kernels.batch import DecodeBatch, KVPool


def reference_decode(pool: KVPool, batch: DecodeBatch) -> torch.Tensor:
    """Attention output of ``batch`` as float64 ``[n, num_q_heads, head_dim]`` on the CPU."""
    shape = pool.shape
    # Promote only the blocks this batch uses: the pool holds every batch of a group.
    query = batch.query.detach().to("cpu", torch.float64)
    out = torch.empty((batch.size, shape.num_q_heads, shape.head_dim), dtype=torch.float64)
    for row, (seq_len, ids) in enumerate(zip(batch.spec.seq_lens, batch.block_ids)):
        index = torch.tensor(ids, dtype=torch.long, device=pool.key_cache.device)
        keys = pool.key_cache.index_select(0, index).to("cpu", torch.float64)
        values = pool.value_cache.index_select(0, index).to("cpu", torch.float64)
        keys = keys.reshape(-1, shape.num_kv_heads, shape.head_dim)[:seq_len]
        values = values.reshape(-1, shape.num_kv_heads, shape.head_dim)[:seq_len]
        # GQA: query head h reads KV head h // queries_per_kv.
        keys = keys.repeat_interleave(shape.queries_per_kv, dim=1)  # [L, H, D]
        values = values.repeat_interleave(shape.queries_per_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[row], keys) * shape.scale
        probs = torch.softmax(scores, dim=-1)
        out[row] = torch.einsum("hl,lhd->hd", probs, values)
    return out
