"""A Triton paged-decode attention kernel: one program per (sequence, query head).

Knows the canonical paged layout (`kernels.batch`) and nothing else. Each
program loads its sequence length and walks that sequence's block-table row
one block at a time, keeping an online softmax in float32 (running max, running
sum, rescaled accumulator), then writes the normalized output in the output's
dtype. A row of sequence length 0 (a padded row) writes zeros.

The scores are elementwise products and sums, not ``tl.dot``: with one query
token there is no matrix to multiply, and it keeps float32 cases free of TF32.

Importing this module imports triton. With ``TRITON_INTERPRET=1`` set before
the import, the kernel runs on CPU tensors in Triton's interpreter, which is
how the CPU tests exercise it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    block_table_ptr,
    seq_lens_ptr,
    scale,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query_ptr + seq * stride_q_seq + head * stride_q_head + offs_d).to(tl.float32)

    running_max = -float("inf")
    running_sum = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    for j in range(0, num_blocks):
        block = tl.load(block_table_ptr + seq * stride_bt_seq + j).to(tl.int64)
        pos = j * BLOCK_SIZE + offs_s
        valid = pos < seq_len
        offs = block * stride_c_block + offs_s[:, None] * stride_c_slot + kv_head * stride_c_head + offs_d[None, :]
        k = tl.load(key_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        rescale = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max)
        v = tl.load(value_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        running_sum = running_sum * rescale + tl.sum(p, axis=0)
        running_max = new_max

    # A padded row (seq_len 0) has acc == 0 and running_sum == 0: write zeros, not NaN.
    out = acc / tl.maximum(running_sum, 1e-30)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    queries_per_kv: int,
) -> None:
    """Write decode attention of ``block_table.shape[0]`` rows into ``out``.

    ``query``/``out`` are ``[rows or more, heads, head_dim]``; the caches are
    ``[num_blocks, block_size, kv_heads, head_dim]`` and contiguous in their
    last dimension. Launches without host synchronization, so it can be
    captured in a CUDA graph.
    """
    rows = block_table.shape[0]
    num_heads = query.shape[1]
    _, block_size, _, head_dim = key_cache.shape
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share strides")
    if query.stride(-1) != 1 or out.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("query, output and caches must be contiguous in head_dim")
    _paged_decode_kernel[(rows, num_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_table,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
