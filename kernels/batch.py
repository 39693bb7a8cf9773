"""Decode batches over a paged KV cache: the inputs every kernel check shares.

Knows the canonical paged layout, how the sequences of a batch get their
blocks, and the metadata a decode step hands a kernel, both exact-size (eager)
and padded to a captured batch size (graph replay). Knows nothing about
kernels, tolerances or graphs.

Layout: ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``. Block 0 is the null block that padded block-table
entries point at. The whole cache, null block included, holds random values:
a kernel that reads the wrong block gets finite but wrong numbers, which is
what the seed's bug looked like (wrong text, no crash).

Decode means one query token per sequence, so ``query_start_loc`` is
``0, 1, ..., n``; a padded row has a query length of 0 (its entry repeats n)
and a sequence length of 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

METADATA_FIELDS = ("block_table", "seq_lens", "query_start_loc")


@dataclass(frozen=True)
class DecodeShape:
    """Head layout and paging of one attention layer."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def label(self) -> str:
        return f"h{self.num_q_heads}kv{self.num_kv_heads}d{self.head_dim}"


@dataclass(frozen=True)
class BatchSpec:
    """A named decode batch: one context length per sequence."""

    name: str
    seq_lens: tuple[int, ...]

    def __post_init__(self):
        if not self.seq_lens or min(self.seq_lens) < 1:
            raise ValueError(f"batch {self.name!r}: every sequence needs a length >= 1, got {self.seq_lens}")


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step's batch, placed in a pool's cache."""

    spec: BatchSpec
    block_ids: tuple[tuple[int, ...], ...]  # per sequence, its blocks in order
    query: torch.Tensor  # [n, num_q_heads, head_dim], pool dtype, pool device

    @property
    def size(self) -> int:
        return len(self.spec.seq_lens)


@dataclass(frozen=True)
class DecodeMetadata:
    """What a kernel reads besides query and cache (all int32, on the kernel's device)."""

    block_table: torch.Tensor  # [rows, max_blocks]
    seq_lens: torch.Tensor  # [rows]
    query_start_loc: torch.Tensor  # [rows + 1]

    @property
    def rows(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device) -> "DecodeMetadata":
        return DecodeMetadata(**{f: getattr(self, f).to(device) for f in METADATA_FIELDS})


@dataclass(frozen=True)
class KVPool:
    """A paged KV cache holding every batch of one (dtype, shape) group."""

    shape: DecodeShape
    dtype: torch.dtype
    device: torch.device
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    batches: tuple[DecodeBatch, ...]
    max_blocks: int  # block-table width: blocks of the longest sequence the pool allows

    @property
    def num_blocks(self) -> int:
        return int(self.key_cache.shape[0])


def blocks_for(seq_len: int, block_size: int) -> int:
    return max(1, math.ceil(seq_len / block_size))


def make_pool(
    *,
    shape: DecodeShape,
    dtype: torch.dtype,
    device: str | torch.device,
    specs: tuple[BatchSpec, ...],
    seed: int,
    max_seq_len: int = 1024,
) -> KVPool:
    """Random cache and queries for ``specs``; identical numbers on every device.

    Values are drawn in float32 on the CPU from ``seed`` and only then cast and
    moved, so a CPU run and a CUDA run of the same case see the same inputs.
    Blocks are handed out from a shuffled list so that block tables are not
    contiguous ranges (a kernel that ignores the table fails).
    """
    device = torch.device(device)
    longest = max(max(s.seq_lens) for s in specs)
    if longest > max_seq_len:
        raise ValueError(f"a sequence of {longest} tokens exceeds max_seq_len {max_seq_len}")
    bs = shape.block_size
    needed = sum(blocks_for(n, bs) for s in specs for n in s.seq_lens)
    num_blocks = 1 + needed  # block 0: the null block
    gen = torch.Generator().manual_seed(seed)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    batches = []
    for spec in specs:
        block_ids = []
        for n in spec.seq_lens:
            k = blocks_for(n, bs)
            block_ids.append(tuple(free[:k]))
            free = free[k:]
        query = torch.randn((len(spec.seq_lens), shape.num_q_heads, shape.head_dim), generator=gen)
        batches.append(DecodeBatch(spec=spec, block_ids=tuple(block_ids), query=query.to(dtype).to(device)))
    return KVPool(
        shape=shape,
        dtype=dtype,
        device=device,
        key_cache=key_cache,
        value_cache=value_cache,
        batches=tuple(batches),
        max_blocks=math.ceil(max_seq_len / bs),
    )


def exact_metadata(batch: DecodeBatch, *, max_blocks: int) -> DecodeMetadata:
    """The metadata of ``batch`` alone, on the CPU: ``batch.size`` rows, no padding."""
    return padded_metadata(batch, max_batch=batch.size, max_blocks=max_blocks)


def padded_metadata(batch: DecodeBatch, *, max_batch: int, max_blocks: int) -> DecodeMetadata:
    """The metadata of ``batch`` padded to ``max_batch`` rows, on the CPU.

    Padded tails are reset the way a correct builder leaves them: sequence
    length 0, block table 0 (the null block), query start repeating n (no
    query tokens). Unused block-table columns of real rows are 0 as well.
    """
    n = batch.size
    if n > max_batch:
        raise ValueError(f"batch {batch.spec.name!r} has {n} sequences, more than max_batch {max_batch}")
    block_table = torch.zeros((max_batch, max_blocks), dtype=torch.int32)
    for row, ids in enumerate(batch.block_ids):
        if len(ids) > max_blocks:
            raise ValueError(f"batch {batch.spec.name!r}: {len(ids)} blocks exceed max_blocks {max_blocks}")
        block_table[row, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    seq_lens = torch.zeros(max_batch, dtype=torch.int32)
    seq_lens[:n] = torch.tensor(batch.spec.seq_lens, dtype=torch.int32)
    query_start_loc = torch.full((max_batch + 1,), n, dtype=torch.int32)
    query_start_loc[: n + 1] = torch.arange(n + 1, dtype=torch.int32)
    return DecodeMetadata(block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc)


def capture_metadata(*, max_batch: int, max_blocks: int) -> DecodeMetadata:
    """The dummy metadata a graph is captured with, as vLLM's
    ``build_for_cudagraph_capture`` leaves it: every row one token long, every
    block-table entry the null block. A replay that reads these instead of the
    current batch attends to one cache slot of the null block."""
    return DecodeMetadata(
        block_table=torch.zeros((max_batch, max_blocks), dtype=torch.int32),
        seq_lens=torch.ones(max_batch, dtype=torch.int32),
        query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32),
    )
