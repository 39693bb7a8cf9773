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

Repeated trials: ``DIFFCHECK_FAULT_SEED`` (an integer 0..2**20, optional), one of this
fault's ``DIFFCHECK_FAULT*`` options (`diffcheck.cases.faults`, which parses it into
``spec.seed``, so a malformed value is refused when a suite loads, like any other option),
picks another, equally reproducible noise stream. Unseeded, the generator of each
(step, layer) is seeded ``1_000_003 * step + layer``, exactly as before the option existed;
with a seed S it is seeded with a 32-bit word that numpy's ``SeedSequence`` hashes from
(S, step, layer) (torch's CPU generator reads only the low 32 bits of a seed, so an offset
above them would change nothing). `bench/bench_verdicts.py` starts one engine per seed to
measure power as the fraction of independent trials flagged.
"""

from __future__ import annotations

import numpy as np
import torch

from diffcheck.faults import runtime

NAME = "attn-noise"


def generator_seed(step: int, layer: int, seed: int | None) -> int:
    """The seed of the noise generator at (decode step, layer): the unseeded formula without `seed`,
    else a 32-bit hash of (seed, step, layer)."""
    if seed is None:
        return 1_000_003 * step + layer
    return int(np.random.SeedSequence([seed, step, layer]).generate_state(1)[0])


def install() -> None:
    """Patch the code path (once per process); it acts while `runtime.active(NAME)` is set."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        spec = runtime.active(NAME)
        if spec is None:
            return out
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
        gen = torch.Generator(device="cpu").manual_seed(
            generator_seed(runtime.STATE.clock.step or 0, layer_index or 0, spec.seed))
        noise = torch.randn(rows.shape, generator=gen, dtype=torch.float32).to(rows.dtype)
        rms = rows.float().pow(2).mean(dim=-1, keepdim=True).sqrt().to(rows.dtype)
        rows.add_(noise * rms * (0.0 if spec.fixed else float(spec.scale or 0.0)))
        return out

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.forward = forward
