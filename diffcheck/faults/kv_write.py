"""Fault `kv-write-corruption`: the decode-step KV write in one layer stores the key as the value.

Patches ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl.do_kv_cache_update``
(called once per attention layer per forward pass, through the ``unified_kv_cache_update``
custom op, before attention reads the cache).

Bug class: a pointer or stride mix-up in ``reshape_and_cache`` (the kernel is handed the
key tensor twice, or the value cache view aliases the key cache), so the value slot
of each newly written token receives its key. Nothing crashes and every shape is
right; attention in that layer then returns key vectors as the values of every token
written from decode step N on, while the prompt's (prefill-written) values stay
correct. The ``:fixed`` variant runs the same staged write with key and value in
their own slots, so its output equals the clean run's.

Only decode-only passes at step >= N write corrupted values, in the layer chosen by
DIFFCHECK_FAULT_LAYER (default 0) or in every layer (``all``).
"""

from __future__ import annotations

from diffcheck.faults import runtime

NAME = "kv-write-corruption"


def install() -> None:
    """Patch the code path (once per process); it acts while `runtime.active(NAME)` is set."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.do_kv_cache_update

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        spec = runtime.active(NAME)
        if spec is None or not spec.layer_matches(runtime.impl_layer_index(self, layer)) or not runtime.acting(spec):
            return original(self, layer, key, value, kv_cache, slot_mapping)
        # The staged write: what lands in the value slot. The bug hands over the key.
        value_source = value if spec.fixed else key
        return original(self, layer, key, value_source, kv_cache, slot_mapping)

    do_kv_cache_update.__wrapped__ = original  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.do_kv_cache_update = do_kv_cache_update

