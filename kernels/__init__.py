"""Kernel-level differential checks for decode attention, graph replay included.

The seed's last advice was to check, before any broad backend A/B run, that
q=1 graph-replay metadata buffers are refreshed before the graph replays.
This package makes that a check:

- `kernels.batch`: paged KV cache, decode batches and their metadata.
- `kernels.reference`: float64 decode attention, the reference.
- `kernels.impls`: the implementations under test (torch SDPA, vLLM's CPU op,
  a Triton paged-decode kernel in `kernels.triton_decode`).
- `kernels.graph`: capture/replay over persistent buffers, metadata builders
  (one correct, two deliberately broken) and the refresh invariant.
- `kernels.compare`: per-dtype tolerances and error statistics.
- `kernels.suite`: the case grid and its run, producing a `SuiteResult`.
- `kernels.results`: result rows, JSON, stored Parquet (blake3-checked), comparison.
- `kernels.table`: the summary table.

Running needs torch and numpy only (``python -m kernels``); storing results as
Parquet needs pyarrow and blake3 and is the ``diffcheck kernels`` command's job.
Nothing here imports vLLM's Python package.
"""
