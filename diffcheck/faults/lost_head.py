"""Fault `lost-head`: one query head's attention output is zero in decode passes from step N.

Patches ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward``.

Bug class: an off-by-one in a kernel's per-head work partition (a head loop bound of
``num_heads - 1``, a split-KV reduction that skips the last partition's head), so one
head's slice of the output buffer is never written and keeps the zeros it was
allocated with. Every shape is right and the other heads are exact, so the text stays
fluent: it degrades instead of collapsing into digit soup, which makes it the hard
case for a classifier.

Modelled as the copy-back of a head-partitioned kernel: the unpatched kernel writes
into a scratch buffer and the heads the partition covers are copied into the real
output buffer; the buggy partition misses DIFFCHECK_FAULT_HEAD (default 0), whose
slice stays zero. The ``:fixed`` variant copies every head back through the same
path, so its output equals the clean run's. Acts in decode-only passes at step >= N,
in DIFFCHECK_FAULT_LAYER (default ``all``).
"""

from __future__ import annotations

import torch

from diffcheck.faults import runtime

NAME = "lost-head"


def install() -> None:
    """Patch the code path (once per process); it acts while `runtime.active(NAME)` is set."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        spec = runtime.active(NAME)
        if (
            spec is None
            or attn_metadata is None
            or attn_metadata.max_query_len != 1
            or not spec.layer_matches(runtime.impl_layer_index(self, layer))
            or not runtime.acting(spec)
        ):
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        num_tokens = int(attn_metadata.num_actual_tokens)
        scratch = torch.empty_like(output)
        original(self, layer, query, key, value, kv_cache, attn_metadata, scratch, *args, **kwargs)
        heads_out = output[:num_tokens].view(num_tokens, self.num_heads, -1)
        heads_scratch = scratch[:num_tokens].view(num_tokens, self.num_heads, -1)
        covered = [h for h in range(self.num_heads) if spec.fixed or h != spec.head]
        heads_out[:, covered] = heads_scratch[:, covered]
        if not spec.fixed:
            heads_out[:, spec.head] = 0  # the unwritten slice of a zero-initialised buffer
        return output

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.forward = forward

