"""vLLM's own decode attention on the GPU, driven the way vLLM drives it, under real CUDA graphs.

Longer than 400 lines because it drives two real vLLM backends through their own metadata builders, CUDA-graph capture and the broken-builder variants.

Two kernels as shipped in vLLM 0.26 (written against that release's source; the
names below are its):

- ``vllm-triton-unified``: ``vllm.v1.attention.backends.triton_attn``:
  ``TritonAttentionMetadataBuilder`` + ``TritonAttentionImpl`` (the Triton
  unified attention kernel, ``vllm.v1.attention.ops.triton_unified_attention``).
- ``vllm-fa3``: ``vllm.v1.attention.backends.flash_attn``:
  ``FlashAttentionMetadataBuilder`` + ``FlashAttentionImpl`` on
  ``vllm_flash_attn`` FA3 (Hopper), AOT scheduler metadata included.

Per decode step, as ``GPUModelRunner`` (V1) does it:

1. the *runner* refreshes its persistent metadata buffers (``query_start_loc``,
   ``seq_lens``, block table; padded tails: query start repeating n, length 0,
   the null block) — here one of `kernels.graph`'s runner builders
   (``refresh``, or the broken ``skip-refresh`` / ``stale-tails``) writing into
   `PersistentBuffers`;
2. a ``CommonAttentionMetadata`` is made of those buffers (`common_metadata`,
   the fields ``_build_attention_metadata`` fills: every row one query token,
   ``num_reqs`` / ``num_actual_tokens`` the padded size under graphs,
   ``max_seq_len`` = max_model_len at capture and the live rows' longest after);
3. vLLM's **own** metadata builder turns it into the backend's metadata:
   ``build_for_cudagraph_capture`` once, at capture; ``build`` before every
   replay (outside the graph, as in vLLM);
4. the backend's impl ``forward`` runs attention over a KV cache in vLLM's
   layout (logical ``[blocks, kv_heads, block_size, 2 * head_dim]``, physical
   NHD, K and V packed in the last dimension). Under graphs that forward is
   captured once in a real ``torch.cuda.CUDAGraph`` over persistent query and
   output buffers and replayed for each new batch.

Before every replay the refresh invariant of `kernels.graph` is checked on what
the graph reads (the tensors of the capture-time backend metadata) against the
batch's padded metadata, and the builder must have handed out those very tensors
(and, for FA3, the persistent scheduler-metadata buffer bound at capture).

Besides the runner builders, the project's ``seq-lens-copy`` fault
(`diffcheck.faults.gpu`) is applied to a subclass of vLLM's real builder
(`faulted_builder`): decode builds hand the kernel a fresh copy of ``seq_lens``,
so replay reads the copy made at capture (lengths of 1). It must be caught by the
invariant and by the output error, without a model. ``seq-lens-copy:fixed`` (a
persistent copy, refreshed every build) must pass.

vLLM is imported lazily (never by importing this module); where its GPU backends
cannot be imported the kernel is unavailable with one line saying why. The pure
parts (`common_metadata_fields`, `backend_view`, `check_backend_invariant`, the
builder config) need torch only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diffcheck_kernels.batch import DecodeBatch, DecodeMetadata, DecodeShape, KVPool, capture_metadata, padded_metadata
from diffcheck_kernels.graph import BUILDERS, PersistentBuffers, ReplayStep, capture, check_invariant
from diffcheck_kernels.impls import Availability, DecodeImpl

LAYER_NAME = "model.layers.0.self_attn.attn"
PAD_SLOT_ID = -1  # vllm.v1.attention.backends.utils.PAD_SLOT_ID: padded rows write no KV
FAULT = "seq-lens-copy"
FIXED = f"{FAULT}:fixed"

# Graph-mode builders of vLLM's backends: name -> (the runner's builder in `kernels.graph`, fault on vLLM's builder).
VARIANTS: dict[str, tuple[str, str | None]] = {
    "refresh": ("refresh", None),
    "skip-refresh": ("skip-refresh", None),
    "stale-tails": ("stale-tails", None),
    FAULT: ("refresh", FAULT),
    FIXED: ("refresh", FIXED),
}


class VllmUnavailable(Exception):
    """vLLM's GPU attention backend cannot be used here; the message is one line."""


@dataclass(frozen=True)
class VllmBackend:
    kernel: str  # the kernel's name in diffcheck
    label: str
    module: str
    builder: str
    impl: str
    dtypes: tuple[torch.dtype, ...]


TRITON = VllmBackend("vllm-triton-unified", "vLLM TRITON_ATTN (unified attention)",
                     "vllm.v1.attention.backends.triton_attn", "TritonAttentionMetadataBuilder", "TritonAttentionImpl",
                     (torch.float32, torch.float16, torch.bfloat16))  # fmt: skip
FA3 = VllmBackend("vllm-fa3", "vLLM FLASH_ATTN (vllm_flash_attn FA3)",
                  "vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder", "FlashAttentionImpl",
                  (torch.float16, torch.bfloat16))  # fmt: skip


@dataclass(frozen=True)
class _Loaded:
    builder: type
    impl: type
    common: type  # CommonAttentionMetadata
    kv_spec: type  # FullAttentionSpec
    graph_modes: Any  # CUDAGraphMode
    version: str


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]


@functools.lru_cache(maxsize=None)
def load(backend: VllmBackend, *, require_cuda: bool = True) -> _Loaded:
    """Import vLLM's backend classes; VllmUnavailable (one line) when they cannot be used.

    ``require_cuda=False`` (tests on the CPU) takes the classes from whatever vLLM is
    installed, whatever its platform: builders then run, kernels do not.
    """
    import importlib

    try:
        vllm = importlib.import_module("vllm")
        from vllm.platforms import current_platform

        if require_cuda and not current_platform.is_cuda():
            raise VllmUnavailable(f"{backend.label}: this vLLM's platform is not CUDA "
                                  f"({type(current_platform).__name__}; a CPU build?)")
        module = importlib.import_module(backend.module)
        from vllm.config import CUDAGraphMode
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except VllmUnavailable:
        raise
    except Exception as exc:  # a missing or broken install: one line, never a traceback
        raise VllmUnavailable(f"vLLM's GPU attention backend {backend.module} cannot be imported: "
                              f"{_one_line(exc)}") from None
    if backend is FA3 and require_cuda:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        version = get_flash_attn_version()
        if version != 3:
            raise VllmUnavailable(f"{backend.label}: vLLM picks FlashAttention {version} on this GPU, not FA3 "
                                  "(FA3 needs Hopper and the _vllm_fa3_C extension)")
    return _Loaded(builder=getattr(module, backend.builder), impl=getattr(module, backend.impl),
                   common=CommonAttentionMetadata, kv_spec=FullAttentionSpec, graph_modes=CUDAGraphMode,
                   version=str(getattr(vllm, "__version__", "?")))


# -- the config a builder reads ----------------------------------------------------------------


class _Unset:
    """An attribute the stand-in config does not set: falsy, equal to nothing, and its own
    attribute (``config.kernel_config.enable_jit_warmup`` is unset, hence false). vLLM 0.26's
    Triton and FlashAttention builders read nothing unset; later releases read more."""

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other) -> bool:
        return False

    __hash__ = object.__hash__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()


class _Config:
    """A stand-in for the parts of ``VllmConfig`` a metadata builder reads; anything not set is
    `UNSET`; dunders are never faked."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return UNSET


class _ModelConfig(_Config):
    """What builders ask the model config for: head counts and size, no model needed."""

    def get_num_attention_heads(self, parallel_config=None) -> int:
        return self.num_heads

    def get_num_kv_heads(self, parallel_config=None) -> int:
        return self.num_kv_heads

    def get_head_size(self) -> int:
        return self.head_size


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's default decode capture sizes up to ``max_batch``: 1, 2, 4, then multiples of 8."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes + [max_batch]))


def builder_config(loaded: _Loaded, shape: DecodeShape, dtype: torch.dtype, *, graphs: bool, max_batch: int,
                   max_model_len: int) -> _Config:
    """The config of one attention layer group: FULL_DECODE_ONLY graphs (or none), the real
    vLLM sub-configs where they build without a model, stand-ins for model and scheduler."""
    modes = loaded.graph_modes
    mode = modes.FULL_DECODE_ONLY if graphs else modes.NONE
    sizes = capture_sizes(max_batch) if graphs else []
    compilation = _sub_config("vllm.config", "CompilationConfig", dict(cudagraph_mode=mode,
                              **({"cudagraph_capture_sizes": sizes} if sizes else {})),  # fmt: skip
                              fallback=dict(cudagraph_mode=mode, cudagraph_capture_sizes=sizes,
                                            static_forward_context={}))
    compilation.max_cudagraph_capture_size = max(sizes) if sizes else 0  # what VllmConfig derives
    if getattr(compilation, "static_forward_context", None) is None:
        compilation.static_forward_context = {}  # no layers registered: builders fall back to the model config
    return _Config(
        model_config=_ModelConfig(num_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                                  head_size=shape.head_dim, dtype=dtype, max_model_len=max_model_len,
                                  rswa_window=None, is_diffusion=False),  # fmt: skip
        compilation_config=compilation,
        cache_config=_sub_config("vllm.config.cache", "CacheConfig", {}, fallback=dict(cache_dtype="auto")),
        parallel_config=_sub_config("vllm.config.parallel", "ParallelConfig", {},
                                    fallback=dict(cp_kv_cache_interleave_size=1, decode_context_parallel_size=1)),
        attention_config=_sub_config("vllm.config.attention", "AttentionConfig", {},
                                     fallback=dict(flash_attn_max_num_splits_for_cuda_graph=32)),
        scheduler_config=_Config(max_num_seqs=max_batch, max_model_len=max_model_len, max_num_batched_tokens=8192),
        speculative_config=None,
    )


def _sub_config(module: str, name: str, kwargs: dict, *, fallback: dict):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)(**kwargs)
    except Exception:  # a release whose config class needs more: the fields builders read
        return _Config(**fallback)


# -- CommonAttentionMetadata from the kernels' batches -------------------------------------------


def common_metadata_fields(meta: DecodeMetadata, *, max_seq_len: int, slot_mapping: torch.Tensor) -> dict[str, Any]:
    """The fields ``GPUModelRunner._build_attention_metadata`` (V1) fills for a decode step, from
    the runner's metadata tensors `meta` (padded to the captured batch size under graphs).

    The tensors are `meta`'s own, never copies: a builder must be handed the runner's
    buffers to keep a graph's addresses. Every row has one query token, so
    ``num_reqs`` and ``num_actual_tokens`` are ``meta.rows`` (padded rows included, as
    under FULL graphs) and ``max_query_len`` is 1. ``max_seq_len``: max_model_len at
    capture, the longest live sequence after. Optional fields vLLM versions differ on
    are left to `common_metadata`, which passes only those its class has.
    """
    rows = meta.rows
    if slot_mapping.shape[0] < rows:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows, the batch {rows}")
    seq_lens_cpu = meta.seq_lens.detach().to("cpu")
    return {
        "query_start_loc": meta.query_start_loc,
        "query_start_loc_cpu": meta.query_start_loc.detach().to("cpu"),
        "seq_lens": meta.seq_lens,
        "_seq_lens_cpu": seq_lens_cpu,
        "seq_lens_cpu_upper_bound": seq_lens_cpu,
        "num_reqs": rows,
        "num_actual_tokens": rows,
        "max_query_len": 1,
        "max_seq_len": int(max_seq_len),
        "block_table_tensor": meta.block_table,
        "slot_mapping": slot_mapping[:rows],
        "causal": True,
        "is_prefilling": torch.zeros(rows, dtype=torch.bool),
    }


def common_metadata(common_cls: type, meta: DecodeMetadata, *, max_seq_len: int, slot_mapping: torch.Tensor):
    """A ``CommonAttentionMetadata`` of `common_metadata_fields`, with the fields this vLLM has."""
    names = {f.name for f in dataclasses.fields(common_cls)}
    fields = common_metadata_fields(meta, max_seq_len=max_seq_len, slot_mapping=slot_mapping)
    required = {f.name for f in dataclasses.fields(common_cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # fmt: skip
    missing = required - set(fields)
    if missing:
        raise VllmUnavailable(f"this vLLM's CommonAttentionMetadata needs {', '.join(sorted(missing))}, "
                              "which diffcheck does not fill (written against vLLM 0.26)")
    return common_cls(**{k: v for k, v in fields.items() if k in names})


def backend_view(md) -> DecodeMetadata:
    """The three tensors a decode kernel reads from a backend's metadata (Triton's or FlashAttention's)."""
    return DecodeMetadata(block_table=md.block_table, seq_lens=md.seq_lens, query_start_loc=md.query_start_loc)


def check_backend_invariant(*, captured, handed, target: DecodeMetadata, rows: int) -> tuple[str, ...]:
    """The refresh invariant on backend metadata: what replay reads (`captured`'s tensors) holds
    the batch (`target`, padded tails included), `handed` (this step's ``build``) hands out
    those very tensors, and FA3's AOT scheduler metadata is the persistent buffer bound at
    capture."""
    violations = list(check_invariant(bound=backend_view(captured), handed=backend_view(handed), target=target,
                                      rows=rows))  # fmt: skip
    bound_sched = getattr(captured, "scheduler_metadata", None)
    if bound_sched is not None:
        sched = getattr(handed, "scheduler_metadata", None)
        if sched is None or sched.data_ptr() != bound_sched.data_ptr() or sched.shape != bound_sched.shape:
            violations.append("scheduler_metadata: the builder handed out a fresh tensor; replay reads the one "
                              "bound at capture")
    return tuple(violations)


def faulted_builder(builder_cls: type, fault: str | None) -> type:
    """`builder_cls`, or a subclass of it with the project's `fault` (``seq-lens-copy`` or its
    ``:fixed`` variant) patched in by `diffcheck.faults.gpu.patch_builder`; vLLM's class stays clean."""
    if fault is None:
        return builder_cls
    from diffcheck.faults import gpu
    from diffcheck.cases.faults import parse_env

    spec = parse_env({"DIFFCHECK_FAULT": fault})
    cls = type(f"{builder_cls.__name__}_{fault.replace('-', '_').replace(':', '_')}", (builder_cls,),
               {"__module__": __name__})  # fmt: skip
    gpu.patch_builder(cls, spec)
    return cls


def vllm_kv_cache(pool: KVPool) -> torch.Tensor:
    """The pool's cache in vLLM's layout: physical NHD ``[blocks, block_size, kv_heads, 2 * head_dim]``
    (K then V in the last dimension), viewed as the logical ``[blocks, kv_heads, block_size, 2 * head_dim]``
    the backends take (their forward transposes back and splits K from V)."""
    return torch.cat([pool.key_cache, pool.value_cache], dim=-1).permute(0, 2, 1, 3)


def _layer(device: torch.device) -> _Config:
    """The attention layer as the impls read it: unit quantization scales (no fp8)."""
    one = functools.partial(torch.tensor, 1.0, dtype=torch.float32, device=device)
    return _Config(_q_scale=one(), _k_scale=one(), _v_scale=one(), _prob_scale=one(), layer_name=LAYER_NAME,
                   mm_prefix_clamp_sliding_window=False)  # fmt: skip


Attend = Callable[[torch.Tensor, Any, torch.Tensor], None]  # (query, backend metadata, out)


@dataclass
class _Parts:
    """One layer group's vLLM objects over one pool."""

    loaded: _Loaded
    builder: Any
    attend: Attend


def _parts(backend: VllmBackend, pool: KVPool, *, graphs: bool, max_batch: int, max_model_len: int,
           fault: str | None = None, attend: Attend | None = None,
           loaded: _Loaded | None = None) -> _Parts:  # fmt: skip
    loaded = loaded or load(backend)
    shape = pool.shape
    config = builder_config(loaded, shape, pool.dtype, graphs=graphs, max_batch=max_batch, max_model_len=max_model_len)
    spec = loaded.kv_spec(shape.block_size, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim,
                          dtype=pool.dtype)  # fmt: skip
    builder = faulted_builder(loaded.builder, fault)(spec, [LAYER_NAME], config, pool.device)
    if attend is None:
        impl = loaded.impl(num_heads=shape.num_q_heads, head_size=shape.head_dim, scale=shape.scale,
                           num_kv_heads=shape.num_kv_heads, alibi_slopes=None, sliding_window=None,
                           kv_cache_dtype="auto")  # fmt: skip
        layer, kv_cache = _layer(pool.device), vllm_kv_cache(pool)
        # Key and value of this step are not written by forward (vLLM writes the cache before it);
        # the impls get them for encoder and context-parallel paths only.
        kv = torch.zeros((max_batch, shape.num_kv_heads, shape.head_dim), dtype=pool.dtype, device=pool.device)

        def attend(query, md, out):
            impl.forward(layer, query, kv[: query.shape[0]], kv[: query.shape[0]], kv_cache, md, out)

    return _Parts(loaded=loaded, builder=builder, attend=attend)


class VllmCapturedDecode:
    """vLLM's builder and impl forward captured over the runner's persistent buffers, replayed per batch.

    `builder`: a name of `VARIANTS` (the runner builder, and the fault applied to vLLM's
    builder). `attend`: the forward to capture (default: the backend impl's); tests on the
    CPU pass another, with the CPU emulation of capture (`kernels.graph.capture`), and
    `loaded` (``load(backend, require_cuda=False)``).
    """

    def __init__(self, backend: VllmBackend, pool: KVPool, *, builder: str, max_batch: int, max_model_len: int,
                 attend: Attend | None = None, loaded: _Loaded | None = None):  # fmt: skip
        if builder not in VARIANTS:
            raise ValueError(f"unknown builder {builder!r} (valid: {', '.join(VARIANTS)})")
        runner_name, fault = VARIANTS[builder]
        self.runner = BUILDERS[runner_name]
        self.max_batch, self.max_blocks = max_batch, pool.max_blocks
        self.buffers = PersistentBuffers.allocate(shape=pool.shape, dtype=pool.dtype, device=pool.device,
                                                  max_batch=max_batch, max_blocks=pool.max_blocks)  # fmt: skip
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT_ID, dtype=torch.int64, device=pool.device)
        self.parts = _parts(backend, pool, graphs=True, max_batch=max_batch, max_model_len=max_model_len, fault=fault,
                            attend=attend, loaded=loaded)  # fmt: skip
        dummy = capture_metadata(max_batch=max_batch, max_blocks=pool.max_blocks)
        runner_md = self.runner.build(dummy, rows=max_batch, buffers=self.buffers)
        cm = common_metadata(self.parts.loaded.common, runner_md, max_seq_len=max_model_len,
                             slot_mapping=self.slot_mapping)  # fmt: skip
        self.captured = self.parts.builder.build_for_cudagraph_capture(cm)
        buffers, captured, forward = self.buffers, self.captured, self.parts.attend
        self.replay = capture(lambda: forward(buffers.query, captured, buffers.output), pool.device)

    def step(self, batch: DecodeBatch) -> ReplayStep:
        """Runner refresh, vLLM's build, the invariant, replay; the live rows of the output."""
        n = batch.size
        target = padded_metadata(batch, max_batch=self.max_batch, max_blocks=self.max_blocks)
        runner_md = self.runner.build(target, rows=n, buffers=self.buffers)
        cm = common_metadata(self.parts.loaded.common, runner_md, max_seq_len=max(batch.spec.seq_lens),
                             slot_mapping=self.slot_mapping)  # fmt: skip
        handed = self.parts.builder.build(0, cm)
        self.buffers.query[:n].copy_(batch.query)
        violations = check_backend_invariant(captured=self.captured, handed=handed, target=target, rows=n)
        self.buffers.output.fill_(math.nan)
        self.replay()
        return ReplayStep(output=self.buffers.output[:n].clone(), violations=violations)


class VllmDecodeImpl(DecodeImpl):
    """One vLLM backend as a kernel of the suite: eager through vLLM's builder and impl, and
    graph-replayed through `VllmCapturedDecode`."""

    # Graph-mode builders beyond "refresh": broken ones (must be CAUGHT) and correct ones (must PASS).
    broken_builders = ("skip-refresh", "stale-tails", FAULT)
    correct_variants = (FIXED,)

    def __init__(self, backend: VllmBackend):
        self.backend = backend
        self.name = backend.kernel

    def availability(self, device, dtype=None):
        if device.type != "cuda":
            return Availability(False, f"{self.backend.label} needs CUDA (vLLM's GPU backend)")
        if dtype is not None and dtype not in self.backend.dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.backend.dtypes)
            return Availability(False, f"{self.backend.label} takes {names} only")
        try:
            loaded = load(self.backend)
        except VllmUnavailable as exc:
            return Availability(False, str(exc))
        return Availability(True, f"vLLM {loaded.version}, {self.backend.module}")

    def tolerance_key(self, dtype_name: str) -> tuple[str, str]:
        """The tolerance row that fits what the kernel computes, and a note when it is not `dtype_name`'s."""
        if self.backend is TRITON and dtype_name == "float32":
            return "float16", ("float32 runs Q·K and P·V through tl.dot, whose default input precision on "
                               "NVIDIA GPUs is TF32 (10 mantissa bits, as float16): judged at the float16 tolerance")
        return dtype_name, ""

    def bind(self, pool):
        parts = _parts(self.backend, pool, graphs=False, max_batch=max(b.size for b in pool.batches),
                       max_model_len=pool.max_blocks * pool.shape.block_size)  # fmt: skip
        slots = torch.full((max(b.size for b in pool.batches),), PAD_SLOT_ID, dtype=torch.int64, device=pool.device)

        def forward(query, meta, out):
            lens = meta.seq_lens.detach().to("cpu")
            cm = common_metadata(parts.loaded.common, meta, max_seq_len=int(lens.max()), slot_mapping=slots)
            parts.attend(query, parts.builder.build(0, cm), out)

        return forward

    def capture_decode(self, pool: KVPool, *, builder: str, max_batch: int, max_model_len: int) -> VllmCapturedDecode:
        return VllmCapturedDecode(self.backend, pool, builder=builder, max_batch=max_batch,
                                  max_model_len=max_model_len)  # fmt: skip


VLLM_IMPLS: dict[str, VllmDecodeImpl] = {b.kernel: VllmDecodeImpl(b) for b in (TRITON, FA3)}
