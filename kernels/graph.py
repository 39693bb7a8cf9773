"""Graph replay of a decode forward over persistent metadata buffers.

The seed's bug class (a FULL decode CUDA graph reading stale attention
metadata) lives here, small enough to test. A forward is *captured* once,
bound to the metadata tensors a builder hands out at capture time and to
persistent query/output buffers sized for ``max_batch`` rows; it is then
*replayed* for each new batch with no arguments. Whatever the bound tensors
hold at replay is what the kernel reads.

A builder turns the current batch's padded metadata into the tensors the
kernel is handed:

- ``refresh`` (correct): ``copy_`` the whole padded metadata, tails included,
  into the persistent buffers and hand those out.
- ``skip-refresh`` (broken, the seed's bug): build fresh tensors each time and
  never touch the persistent buffers. The graph keeps reading the tensors it
  was captured with, which hold the capture-time dummies.
- ``stale-tails`` (broken): copy the live rows but leave padded tail rows as
  an earlier, larger batch left them.

Before each replay, `check_invariant` compares what the graph will read (the
bound tensors) against the batch's padded metadata, row by row and tail by
tail, and checks that the builder handed out the bound tensors themselves.

On CUDA the capture is a real ``torch.cuda.CUDAGraph``. On the CPU it is an
emulation with the same semantics: a closure over the tensors bound at
capture, called without arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from diffcheck_kernels.batch import METADATA_FIELDS, DecodeBatch, DecodeMetadata, DecodeShape, capture_metadata, padded_metadata
from diffcheck_kernels.impls import Forward


@dataclass(frozen=True)
class PersistentBuffers:
    """Inputs and output of a captured forward, sized for ``max_batch`` rows."""

    query: torch.Tensor  # [max_batch, heads, head_dim]
    output: torch.Tensor  # [max_batch, heads, head_dim]
    metadata: DecodeMetadata  # padded: [max_batch, max_blocks], [max_batch], [max_batch + 1]

    @property
    def max_batch(self) -> int:
        return int(self.query.shape[0])

    @staticmethod
    def allocate(*, shape: DecodeShape, dtype: torch.dtype, device: torch.device, max_batch: int, max_blocks: int):
        rows = (max_batch, shape.num_q_heads, shape.head_dim)
        meta = DecodeMetadata(
            block_table=torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_batch, dtype=torch.int32, device=device),
            query_start_loc=torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
        )
        return PersistentBuffers(
            query=torch.zeros(rows, dtype=dtype, device=device),
            output=torch.zeros(rows, dtype=dtype, device=device),
            metadata=meta,
        )


class RefreshBuilder:
    """Correct: refresh the persistent buffers in place, padded tails included."""

    name = "refresh"

    def build(self, target: DecodeMetadata, *, rows: int, buffers: PersistentBuffers) -> DecodeMetadata:
        for field in METADATA_FIELDS:
            getattr(buffers.metadata, field).copy_(getattr(target, field), non_blocking=True)
        return buffers.metadata


class SkipRefreshBuilder:
    """Broken (the seed's bug): fresh tensors each build; the persistent buffers are never written."""

    name = "skip-refresh"

    def build(self, target: DecodeMetadata, *, rows: int, buffers: PersistentBuffers) -> DecodeMetadata:
        device = buffers.query.device
        return DecodeMetadata(**{f: getattr(target, f).to(device, copy=True) for f in METADATA_FIELDS})


class StaleTailsBuilder:
    """Broken: refresh the live rows only; padded tail rows keep what an earlier batch wrote."""

    name = "stale-tails"

    def build(self, target: DecodeMetadata, *, rows: int, buffers: PersistentBuffers) -> DecodeMetadata:
        meta = buffers.metadata
        meta.block_table[:rows].copy_(target.block_table[:rows], non_blocking=True)
        meta.seq_lens[:rows].copy_(target.seq_lens[:rows], non_blocking=True)
        meta.query_start_loc[: rows + 1].copy_(target.query_start_loc[: rows + 1], non_blocking=True)
        return meta


BUILDERS = {b.name: b for b in (RefreshBuilder(), SkipRefreshBuilder(), StaleTailsBuilder())}


def check_invariant(*, bound: DecodeMetadata, handed: DecodeMetadata, target: DecodeMetadata, rows: int) -> tuple[str, ...]:
    """Violations of the refresh invariant before a replay; empty when it holds.

    ``bound``: the tensors the graph was captured with (what replay reads).
    ``handed``: what the builder returned for this batch. ``target``: the
    batch's padded metadata. ``rows``: how many rows are live.
    """
    contents, bindings = [], []
    for field in METADATA_FIELDS:
        bound_t, handed_t = getattr(bound, field), getattr(handed, field)
        if handed_t.data_ptr() != bound_t.data_ptr() or handed_t.shape != bound_t.shape:
            bindings.append(f"{field}: the builder handed out a fresh tensor; replay reads the one bound at capture")
        current = bound_t.detach().cpu()
        want = getattr(target, field)
        live = rows + 1 if field == "query_start_loc" else rows
        if not torch.equal(current[:live], want[:live]):
            bad = int((current[:live] != want[:live]).reshape(live, -1).any(dim=1).nonzero()[0])
            contents.append(f"{field}[{bad}] is {_short(current[bad])}, the batch has {_short(want[bad])}")
        if not torch.equal(current[live:], want[live:]):
            bad = live + int((current[live:] != want[live:]).reshape(len(want) - live, -1).any(dim=1).nonzero()[0])
            contents.append(f"padded tail {field}[{bad}] is {_short(current[bad])}, not reset to {_short(want[bad])}")
    # What replay will read comes first; why (a fresh tensor) second.
    violations = contents + bindings
    return tuple(violations)


def _short(t: torch.Tensor) -> str:
    values = t.reshape(-1).tolist()
    if len(values) == 1:
        return str(values[0])
    head = ",".join(str(v) for v in values[:4])
    return f"[{head}{',...' if len(values) > 4 else ''}]"


def capture(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """Capture ``fn`` (a forward bound to fixed tensors) and return its replay.

    CUDA: warm up on a side stream (compiles Triton, initializes cuBLAS/SDPA
    workspaces outside the capture), capture one call into a CUDAGraph, and
    replay it followed by a synchronize. CPU: the closure itself.
    """
    if device.type != "cuda":
        return fn
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)

    def replay() -> None:
        graph.replay()
        torch.cuda.synchronize(device)

    replay.graph = graph  # type: ignore[attr-defined]  # keep the graph alive with its replay
    return replay


@dataclass(frozen=True)
class ReplayStep:
    output: torch.Tensor  # [rows, heads, head_dim], a copy of the live rows
    violations: tuple[str, ...]


class CapturedDecode:
    """A forward captured over persistent buffers with one builder, replayed per batch."""

    def __init__(self, forward: Forward, *, builder, shape: DecodeShape, dtype: torch.dtype, device: torch.device,
                 max_batch: int, max_blocks: int):  # fmt: skip
        self.builder = builder
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.buffers = PersistentBuffers.allocate(
            shape=shape, dtype=dtype, device=device, max_batch=max_batch, max_blocks=max_blocks
        )
        dummy = capture_metadata(max_batch=max_batch, max_blocks=max_blocks)
        self.bound = builder.build(dummy, rows=max_batch, buffers=self.buffers)
        buffers, bound = self.buffers, self.bound
        self.replay = capture(lambda: forward(buffers.query, bound, buffers.output), device)

    def step(self, batch: DecodeBatch) -> ReplayStep:
        """Refresh through the builder, check the invariant, replay, return the live rows."""
        n = batch.size
        target = padded_metadata(batch, max_batch=self.max_batch, max_blocks=self.max_blocks)
        handed = self.builder.build(target, rows=n, buffers=self.buffers)
        # The query is an input like input ids: the runner copies it in; its tail is never read.
        self.buffers.query[:n].copy_(batch.query)
        violations = check_invariant(bound=self.bound, handed=handed, target=target, rows=n)
        # A row the replay does not write stays NaN and fails, instead of
        # showing a previous replay's (possibly right) answer.
        self.buffers.output.fill_(float("nan"))
        self.replay()
        return ReplayStep(output=self.buffers.output[:n].clone(), violations=violations)
