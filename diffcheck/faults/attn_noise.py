"""Fault `attn-noise`: relative Gaussian noise on attention outputs in decode passes from step N.

Patches ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.forward``.

Bug class: a numerically wrong kernel whose error grows with a knob (a reduced-
precision accumulator, a split-K reduction with a lossy partial sum, a wrong scale):
every shape is right and the error is small and unbiased per element. Its strength,
DIFFCHECK_FAULT_SCALE, is the noise's standard deviation relative to the RMS of each
token's attention output, so the self-test can measure the smallest strength
diffcheck flags (its power). The noise is a fixed function of (step, layer), so runs
are reproducible. The ``:fixed`` variant runs the same path with scale 0.
Acts in decode-only passes at step >= N, in DIFFCHECK_FAULT_LAYER (default ``all``).
"""

from __future__ import annotations

import torch

from diffcheck.faults import runtime
from diffcheck.cases.faults import FaultSpec


def install(spec: FaultSpec) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.forward
    scale = 0.0 if spec.fixed else float(spec.scale or 0.0)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        layer_index = runtime.impl_layer_index(self, layer)
        if (
            attn_metadata is None
            or attn_metadata.max_query_len != 1
            or not spec.layer_matches(layer_index)
            or not runtime.acting(spec)
        ):
            return out
        num_tokens = int(attn_metadata.num_actual_tokens)
        rows = out[:num_tokens]
        gen = torch.Generator(device="cpu").manual_seed(1_000_003 * (runtime.STATE.clock.step or 0) + (layer_index or 0))
        noise = torch.randn(rows.shape, generator=gen, dtype=torch.float32).to(rows.dtype)
        rms = rows.float().pow(2).mean(dim=-1, keepdim=True).sqrt().to(rows.dtype)
        rows.add_(noise * rms * scale)
        return out

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.forward = forward
