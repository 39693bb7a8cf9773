"""Kernel-level differential checks for decode attention, graph replay included.

The seed's last advice was to check, before any broad backend A/B run, that
q=1 graph-replay metadata buffers are refreshed before the graph replays.
This package makes that a check:

- `kernels.batch`: paged KV cache, decode batches and their metadata.
- `kernels.reference`: float64 decode attention, the reference.
- `kernels.impls`: the implementations under test (torch SDPA, vLLM's CPU op,
  a Triton paged-decode kernel in `kernels.triton_decode`).
- `kernels.vllm_gpu`: vLLM's own GPU decode attention (Triton unified attention,
  FA3) driven through vLLM's metadata builders, captured in CUDA graphs, with the
  seq-lens-copy fault applied to the real builder.
- `kernels.graph`: capture/replay over persistent buffers, metadata builders
  (one correct, two deliberately broken) and the refresh invariant.
- `kernels.compare`: per-dtype tolerances and error statistics.
- `kernels.suite`: the case grid and its run, producing a `SuiteResult`.
- `kernels.results`: result rows, JSON, stored Parquet (blake3-checked), comparison.
- `kernels.table`: the summary table.

Running needs torch and numpy only (``python -m kernels``); storing results as
Parquet needs pyarrow and blake3 and is the ``diffcheck kernels`` command's job.
Only `kernels.vllm_gpu` imports vLLM's Python package, lazily, when its kernels
run; without vLLM's GPU backends they are skipped with one line saying why.
"""
