"""Fault `stale-decode-metadata`: the seed's root-cause class on the CPU attention backend.

Patches ``vllm.v1.attention.backends.cpu_attn.CPUAttentionMetadataBuilder.build``.

The real bug (Flash-V100, TP4, FULL decode CUDA graph): ``build_for_cudagraph_capture``
bound the q=1 decode graph to persistent ``block_table`` / ``seq_lens`` /
``query_start_loc`` buffers, but the runtime ``build()`` never refreshed them before
``run_fullgraph()``, so every replay read the metadata of capture time instead of the
current batch's. CUDA graphs never run on CPU, so this module models the graph's
persistent-buffer contract in the builder itself:

- Each builder owns persistent buffers sized like a graph captured for the largest
  batch (``max_num_seqs`` rows, the block table's full width). Rows never written by a
  capture hold capture-time dummies, like ``build_for_cudagraph_capture`` writes:
  ``seq_len = 1``, block ``NULL_BLOCK_ID`` (0), ``query_start_loc = arange``.
- At the first decode-only pass at decode step >= N ("capture") the current batch's
  metadata is copied into the buffers.
- Every decode-only pass from then on hands the kernel slices of those buffers (this
  is what a graph replay reads). The buggy path skips the refresh, so the kernel sees
  the capture step's ``seq_lens``, block table, ``query_start_loc`` and ``max_seq_len``;
  scheduler metadata is computed from them, as it would be baked into the graph.
  The ``:fixed`` path refreshes the buffers from the current batch first, so the
  kernel reads the right values through the same buffers: output equals the clean run.
- ``slot_mapping`` (the KV write) stays fresh: it belongs to the runner, which refreshes
  its own persistent buffers in the real system.

Batch-size changes: when a sequence finishes at EOS the runner condenses the batch
(the last row moves into the freed row), and the stale rows no longer belong to the
request now in that row: it attends over another request's blocks, as a real stale
replay would. A decode batch larger than the buffers runs the unpatched build (a real
runner falls back to eager beyond its largest captured size). Any non-decode pass
starts a new epoch and the next decode pass at step >= N captures again, so every
``generate()`` call on one engine behaves the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffcheck.faults import runtime

NAME = "stale-decode-metadata"

NULL_BLOCK_ID = 0  # vllm.v1.attention.backends.utils.NULL_BLOCK_ID: block 0 is the padding block


@dataclass
class _PersistentDecodeBuffers:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int = 1
    epoch: int = -1  # clock epoch of the capture; -1: never captured

    @property
    def capacity(self) -> int:
        return int(self.seq_lens.shape[0])

    @staticmethod
    def allocate(*, rows: int, like_seq_lens: torch.Tensor, like_block_table: torch.Tensor,
                 like_query_start_loc: torch.Tensor) -> "_PersistentDecodeBuffers":
        return _PersistentDecodeBuffers(
            seq_lens=torch.ones(rows, dtype=like_seq_lens.dtype, device=like_seq_lens.device),
            block_table=torch.full((rows, like_block_table.shape[1]), NULL_BLOCK_ID,
                                   dtype=like_block_table.dtype, device=like_block_table.device),
            query_start_loc=torch.arange(rows + 1, dtype=like_query_start_loc.dtype,
                                         device=like_query_start_loc.device),
        )

    def refresh(self, common, num_reqs: int) -> None:
        """Copy the current batch's metadata into rows [0, num_reqs) (what a correct builder does)."""
        self.seq_lens[:num_reqs].copy_(common.seq_lens[:num_reqs])
        self.block_table[:num_reqs].copy_(common.block_table_tensor[:num_reqs])
        self.query_start_loc[: num_reqs + 1].copy_(common.query_start_loc[: num_reqs + 1])
        self.max_seq_len = int(common.max_seq_len)


def install() -> None:
    """Patch the code path (once per process); it acts while `runtime.active(NAME)` is set."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    original = CPUAttentionMetadataBuilder.build

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        common = common_attn_metadata
        spec = runtime.active(NAME)
        if spec is None or common.max_query_len != 1 or not runtime.acting(spec):
            return original(self, common_prefix_len, common, fast_build)
        num_reqs = int(common.num_reqs)
        buffers = getattr(self, "_diffcheck_decode_buffers", None)
        if buffers is None:
            rows = max(int(self.vllm_config.scheduler_config.max_num_seqs), num_reqs)
            buffers = _PersistentDecodeBuffers.allocate(
                rows=rows,
                like_seq_lens=common.seq_lens,
                like_block_table=common.block_table_tensor,
                like_query_start_loc=common.query_start_loc,
            )
            self._diffcheck_decode_buffers = buffers
        if num_reqs > buffers.capacity:
            return original(self, common_prefix_len, common, fast_build)
        epoch = runtime.current_epoch()
        if buffers.epoch != epoch:
            buffers.refresh(common, num_reqs)  # capture
            buffers.epoch = epoch
        elif spec.fixed:
            buffers.refresh(common, num_reqs)  # the fix: refresh before every replay
        replayed = common.replace(
            seq_lens=buffers.seq_lens[:num_reqs],
            block_table_tensor=buffers.block_table[:num_reqs],
            query_start_loc=buffers.query_start_loc[: num_reqs + 1],
            query_start_loc_cpu=buffers.query_start_loc[: num_reqs + 1],
            max_seq_len=buffers.max_seq_len,
            # caches derived from the fresh seq_lens must not leak into the replayed view
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return original(self, common_prefix_len, replayed, fast_build)

    build.__wrapped__ = original  # type: ignore[attr-defined]
    CPUAttentionMetadataBuilder.build = build
