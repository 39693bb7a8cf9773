"""Fault `seq-lens-copy`: the seed's bug class on real CUDA graphs (GPU only).

Patches ``vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.build``.

The bug: on decode-only batches (``max_query_len == 1``) the builder hands the
Triton kernels a fresh copy of ``seq_lens`` (``md.seq_lens = md.seq_lens.clone()``)
instead of the runner's persistent buffer. In eager mode that is harmless: the
copy holds this step's values. Under a FULL decode CUDA graph it is not: the graph
bakes in the device address of the copy made at *capture*, where
``build_for_cudagraph_capture`` then set ``seq_lens`` to 1. Every replay reads those
capture-time lengths while the runner refreshes only its persistent buffer, so
each decode step attends over one token: garbage from the first decode steps
(seen on an H200 with vLLM 0.26: "ACEShiclesCEShicles...").

Because the damage is done at capture time, before any decode step exists, this
fault acts on every decode-only build, capture builds included:
``DIFFCHECK_FAULT_STEP`` does not apply to it (a graph cannot be told to start
misbehaving at step N by a change the graph never sees).

The ``:fixed`` variant keeps the copy but makes it persistent (one buffer per
batch size, per builder) and refreshes it from the runner's buffer in every
build: the graph-safe way to hand a kernel derived metadata. Its output equals
the clean run's under graphs and in eager mode.

On a machine without CUDA the fault refuses to install (one-line ConfigError):
CPU vLLM has neither the Triton backend's graphs nor CUDA graphs, so the fault
would silently do nothing there (use ``stale-decode-metadata`` on CPU).

`patch_builder` applies the same patch to any metadata builder class whose
metadata carries ``seq_lens``: `install` patches vLLM's Triton builder in the
engine; ``diffcheck kernels --device cuda`` patches subclasses of vLLM's Triton and
FlashAttention builders (`kernels/vllm_gpu.py`), without a model.
"""

from __future__ import annotations

import os

from diffcheck.core.errors import ConfigError
from diffcheck.faults import runtime
from diffcheck.cases.faults import FaultSpec

NAME = "seq-lens-copy"


def _on_cuda() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def _announce_acting(spec: FaultSpec, *, capture: bool) -> None:
    """The first decode-only build this process patches: log line and marker event."""
    if runtime.STATE.announced_acting:
        return
    runtime.STATE.announced_acting = True
    # Step None: a build outside the decode-step clock (warm-up or capture, before any prefill).
    runtime.log.warning("diffcheck fault %s acting from its first decode-only build (graph capture: %s, "
                        "decode step %s) in pid %d", spec.label, capture, runtime.STATE.clock.step, os.getpid())
    runtime.write_marker("acting", step=runtime.STATE.clock.step, capture=capture)


def install() -> None:
    """Patch vLLM's Triton metadata builder (once per process); it acts while `runtime.active(NAME)` is set."""
    if not _on_cuda():
        raise ConfigError(
            f"fault {NAME!r} needs CUDA (TritonAttentionMetadataBuilder under FULL decode CUDA graphs); "
            "this vLLM runs on another platform (on CPU use stale-decode-metadata)"
        )
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    patch_builder(TritonAttentionMetadataBuilder)


def patch_builder(cls, spec: FaultSpec | None = None) -> None:
    """Patch `cls.build` and `cls.build_for_cudagraph_capture` with the fault (or its ``:fixed`` variant):
    `spec`, or this process's active fault where it is this one (`runtime.active`)."""
    given = spec
    original = cls.build
    original_capture = cls.build_for_cudagraph_capture
    capturing = {"now": False}

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
        md = original(self, common_prefix_len, common_attn_metadata, fast_build, **kwargs)
        spec = given if given is not None else runtime.active(NAME)
        if spec is None or common_attn_metadata.max_query_len != 1:
            return md
        _announce_acting(spec, capture=capturing["now"])
        if spec.fixed:
            # One persistent copy per padded batch size: a graph captured for that size
            # keeps its address, and every build refreshes it before the replay.
            copies = self.__dict__.setdefault("_diffcheck_seq_lens_copies", {})
            key = (tuple(md.seq_lens.shape), md.seq_lens.dtype, str(md.seq_lens.device))
            persistent = copies.get(key)
            if persistent is None:
                persistent = copies[key] = md.seq_lens.clone()
            persistent.copy_(md.seq_lens)
            md.seq_lens = persistent
        else:
            md.seq_lens = md.seq_lens.clone()  # the bug: a fresh tensor every build
        return md

    def build_for_cudagraph_capture(self, common_attn_metadata):
        # Marks capture builds (for the log line only); the base class calls build().
        capturing["now"] = True
        try:
            return original_capture(self, common_attn_metadata)
        finally:
            capturing["now"] = False

    build.__wrapped__ = original  # type: ignore[attr-defined]
    build_for_cudagraph_capture.__wrapped__ = original_capture  # type: ignore[attr-defined]
    cls.build = build
    cls.build_for_cudagraph_capture = build_for_cudagraph_capture
