"""Fault `rope-offset`: decode positions handed to rotary embedding are shifted by OFFSET.

Patches ``vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward_cpu``
and ``.forward_native`` (the CPU custom op and its PyTorch fallback). ``CustomOp``
binds the implementation when a layer is built, so the patch must be in place before
the model is loaded, which the ``vllm.general_plugins`` entry point guarantees. Rotary
classes that override these methods (YaRN, Llama-3 scaling, M-RoPE, ...) are not
patched; SmolLM2 uses the plain class.

Bug class: decode positions computed from the wrong counter (``seq_len`` instead of
``num_computed_tokens``, a stale or mis-offset position buffer) while the KV write
uses the right slot. Queries and newly cached keys of decode tokens are rotated for
``position + OFFSET`` (clamped to the cos/sin cache), so the relative distance to the
prompt's keys is wrong while distances among decode tokens stay right. The
``:fixed`` variant computes the positions through the same path without the offset.

RoPE runs inside the model's traced region: the fault is meant for eager engines
(``enforce_eager=True``); under torch.compile the patched Python would be traced once.
"""

from __future__ import annotations

from diffcheck.faults import runtime

NAME = "rope-offset"


def install() -> None:
    """Patch the code path (once per process); it acts while `runtime.active(NAME)` is set."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    for method_name in ("forward_cpu", "forward_native"):
        setattr(RotaryEmbedding, method_name, _wrap(getattr(RotaryEmbedding, method_name)))


def _wrap(original):
    def forward(self, positions, query, key=None):
        spec = runtime.active(NAME)
        if spec is not None and runtime.acting(spec):
            offset = 0 if spec.fixed else int(spec.offset or 0)
            last = int(self.cos_sin_cache.shape[0]) - 1  # positions index the cos/sin cache
            positions = (positions + offset).clamp(min=0, max=last)
        return original(self, positions, query, key)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    return forward
